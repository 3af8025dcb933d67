"""Where a bench case runs and what it measures there: the GPU or the CPU and the threads of a case on a CPU
(`threads`), whether a case can run on this machine (`missing`: what a case `needs`), synchronising before a clock is
read, and peak memory (the CUDA allocator's, or on a CPU the process's resident set, /proc/self/status)."""

from __future__ import annotations

import os
from pathlib import Path


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def threads(cfg) -> int:
    """The torch threads of every case on a CPU: `bench.threads`, else one per core this process may use; shared out
    where a case runs in several processes (torchrun's `LOCAL_WORLD_SIZE`: oversubscribed cores slow every one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cfg.bench.threads or cores) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def memory_reset(device: str) -> float:
    """Start a peak-memory measurement here; return the baseline in GiB."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**30
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak resident set to the current one
    return proc_status("VmRSS")


def memory_peak(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else proc_status("VmHWM")


def proc_status(key: str) -> float:
    """A memory line of /proc/self/status, in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {key} in /proc/self/status")


def gpu_missing() -> str | None:
    """Why the GPU-only cases cannot run here (`packing_flex`: FlexAttention has no backward on a CPU), or None."""
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU (FlexAttention has no backward on a CPU)"


def liger_missing() -> str | None:
    """Why `packing_liger` cannot run here (Liger's kernels are Triton's: a GPU, and liger-kernel), or None."""
    import importlib.util

    if gpu_missing():
        return "needs a CUDA GPU (Liger's kernels are Triton's)"
    return None if importlib.util.find_spec("liger_kernel") else "needs liger-kernel (pip install -e '.[gpu]')"


def flash_missing() -> str | None:
    """Why `packing_flash` cannot run here (flash attention's varlen kernel: a GPU, and flash-attn), or None."""
    import importlib.util

    if gpu_missing():
        return "needs a CUDA GPU (flash-attn's kernels are CUDA's)"
    return None if importlib.util.find_spec("flash_attn") else ("needs flash-attn (pip install flash-attn "
                                                                "--no-build-isolation: built for the machine's CUDA)")


def bf16_missing() -> str | None:
    """Why the bf16 cases cannot run here (no GPU, and a CPU without bf16 instructions), or None."""
    import torch

    from sft.training.processes.precision import cpu_bf16_instructions

    if torch.cuda.is_available() or cpu_bf16_instructions():
        return None
    return "no GPU, and this CPU has no bf16 instructions (sft.training.processes.precision)"


def trl_missing() -> str | None:
    """Why the TRL cases cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[bench]')"
    return None


def missing(need: str) -> str | None:
    """Why a case that needs `need` (a `Case.needs` item: trl, bf16, gpu, liger, flash) cannot run here, or None. Looked
    up by name at each call, so that a test may stand in for one."""
    import sys

    return getattr(sys.modules[__name__], f"{need}_missing")()
