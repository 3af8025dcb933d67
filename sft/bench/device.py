"""Where a bench case runs and what it measures there: the GPU or the CPU, synchronising before a clock is read, and
peak memory (the CUDA allocator's, or on a CPU the process's resident set, /proc/self/status)."""

from __future__ import annotations

from pathlib import Path


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


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
