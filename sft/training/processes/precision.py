"""bf16 on a CPU: which CPUs multiply bf16 matrices natively, so that `trainer.bf16=true` pays off there.

transformers refuses `bf16=True` without a GPU unless `use_cpu=True` ("Your setup doesn't support bf16/gpu"), and
with `use_cpu=True` it accepts any CPU, where one without bf16 instructions emulates them (slower than fp32). sft
turns bf16 on for a CPU that has them (`cpu_bf16_instructions`: AVX512-BF16 or AMX on x86, BF16 on Arm; read from
the kernel's CPU flags, without importing torch) and refuses it in one line on one that has none.

    cpu_bf16_instructions()  # "amx_bf16 avx512_bf16" on a Sapphire Rapids or Zen 4 server, None on a Skylake
"""

from __future__ import annotations

import platform
import subprocess
from functools import cache
from pathlib import Path

X86_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's flags: AMX tiles, AVX512-BF16 dot products
ARM_FLAGS = ("bf16",)  # /proc/cpuinfo's Features on Arm (ARMv8.6 BF16: Graviton 3, Neoverse V1/N2, ...)


@cache
def cpu_bf16_instructions() -> str | None:
    """The bf16 instructions this CPU has (their flag names, space-separated), or None where it has none, or where
    they cannot be read (a system other than Linux or macOS)."""
    if platform.system() == "Darwin":  # Apple silicon: M2 and later
        try:
            out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return "FEAT_BF16" if out == "1" else None
    try:
        return bf16_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def bf16_flags(cpuinfo: str) -> str | None:
    """The bf16 flags among the CPU flags of a /proc/cpuinfo text (x86's `flags`, Arm's `Features` lines), or None.

        bf16_flags("flags : fpu sse avx512f avx512_bf16 amx_bf16") == "amx_bf16 avx512_bf16"
    """
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return " ".join(flag for flag in X86_FLAGS + ARM_FLAGS if flag in flags) or None


NO_BF16_CPU = ("bf16 mixed precision needs bf16 arithmetic, and there is no GPU here and this CPU has no bf16 "
               "instructions (AVX512-BF16 or AMX on x86, BF16 on Arm), so every bf16 product would be emulated, slower "
               "than fp32: set trainer.bf16=false")
