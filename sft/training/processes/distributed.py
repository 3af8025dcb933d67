"""Process-group details the launchers leave to the program: one run dir, rank-0 outputs, CPU back ends.

- `share_run_dir`: every rank of a torchrun/accelerate launch uses rank 0's run dir;
- `rank_overrides`: ranks other than 0 write no `.hydra/` and no log file;
- `single_process_distributed_env`, `slurm_distributed_env`: the torch.distributed variables DeepSpeed
  needs without a launcher, and under SLURM tasks;
- `gloo_deepspeed_state`: DeepSpeed with several processes on machines without GPUs;
- `fsdp_without_gpus`: accelerate's FSDP2 plugin on a CPU (gloo) process group;
- `process_fields`: the TrainingArguments fields these decide;
- `refuse_multirun_in_launch`: `-m` cannot run inside a multi-process launch;
- `exit_without_teardown`: a finished run's process ends without the interpreter's teardown of its modules;
- `set_cpu_threads`: on CPU, torch's threads shared out among the processes of the machine, and a warning
  when other work already loads its cores; `reuse_freed_memory`: on CPU, glibc's allocator keeps the memory of freed
  tensors for the next step instead of returning it to the system.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from sft.ranks import is_local_rank_zero, is_rank_zero


def slurm_distributed_env() -> None:
    """Under a SLURM job step of several tasks (`srun`, hydra/launcher=slurm), one task per process (per GPU):
    torch.distributed's variables from SLURM's. A process of the batch script itself is no rank, however many tasks
    the allocation has (it would wait for peers that never come), nor one a launcher numbered (torchrun's RANK).

    MASTER_ADDR and MASTER_PORT, where not set (the example sbatch script and the launcher presets set them): the
    step's first node's address (its NodeAddr) and a port from the job's id, the same on every task.
    """
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if "RANK" in os.environ or tasks <= 1:
        return
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=str(tasks), LOCAL_RANK=os.environ["SLURM_LOCALID"],
                      LOCAL_WORLD_SIZE=os.environ.get("SLURM_STEP_TASKS_PER_NODE",
                                                      os.environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0])
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = first_node_address(os.environ.get("SLURM_STEP_NODELIST",
                                                                      os.environ.get("SLURM_JOB_NODELIST", "")))


def first_node_address(nodelist: str) -> str:
    """The address of a SLURM node list's first node: its NodeAddr (what SLURM itself reaches it at; a node's name
    need not resolve), else its name."""
    import subprocess

    try:
        first = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=30).stdout.split()[0]
        node = subprocess.run(["scontrol", "show", "node", "-o", first], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return nodelist.split(",")[0]
    return next((item.split("=", 1)[1] for item in node.split() if item.startswith("NodeAddr=")), first)


def single_process_distributed_env() -> None:
    """Let DeepSpeed run without a launcher: the env a one-process `torchrun` would set."""
    import socket

    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)


def gloo_deepspeed_state() -> dict:
    """Set up accelerate's process state for DeepSpeed on CPU; return the matching `accelerator_config`.

    Without a GPU accelerate picks no backend for DeepSpeed and then counts one process, while DeepSpeed
    runs them all: the loss would be scaled and reduced wrongly. Initialising the state with gloo first,
    and telling TrainingArguments to use it, gives both the true world size.
    """
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"use_configured_state": True}


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_fields(deepspeed: bool, fsdp: bool, on_gpu: bool) -> dict:
    """TrainingArguments fields for this launch's processes (and the environment DeepSpeed and FSDP need)."""
    fields = {}
    if deepspeed or fsdp:
        single_process_distributed_env()  # both shard over a process group, of one process too
    if not on_gpu and not deepspeed and (world_size() > 1 or fsdp):
        fields["use_cpu"] = True  # else accelerate sees no GPU and runs each rank alone; DeepSpeed inits gloo itself
    if deepspeed and not on_gpu:
        fields["accelerator_config"] = gloo_deepspeed_state()
    return fields


@contextlib.contextmanager
def fsdp_without_gpus(fsdp: bool):
    """While the Accelerator is created, let accelerate's FSDP plugin take a CPU (gloo) process group.

    accelerate turns FSDP on only for a GPU-type process group (`AcceleratorState`, accelerate 1.15); on CPU
    it would silently train with DDP instead. `fully_shard` itself runs on gloo, so while the Accelerator is
    created the CPU group is presented as a GPU one (`sft.training.compat.present_cpu_group_as_gpu`); accelerate
    then records FSDP as the process state's type (its own `AcceleratorState` does), or, where it did not, the
    CPU type is put back.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    from sft.training.compat import present_cpu_group_as_gpu

    state = PartialState()
    if not fsdp or state.distributed_type != DistributedType.MULTI_CPU:
        yield
        return
    with present_cpu_group_as_gpu(state):
        yield


def refuse_multirun_in_launch(argv: list[str]) -> None:
    """Exit with the reason when `-m` is asked for inside a multi-process launch."""
    if world_size() > 1 and {"-m", "--multirun"} & set(argv):
        from sft.training.processes.rank_errors import report

        report("-m/--multirun cannot run inside a multi-process launch (every rank would run the whole sweep). Run "
               "`./launch.sh -m ...` (each job in turn through accelerate launch) or use hydra/launcher=slurm (one "
               "allocation per job).", 2)
        sys.exit(2)


def share_run_dir() -> None:
    """Give every rank of a multi-process launch one run dir, rank 0's, before Hydra picks one per rank.

    torchrun and `accelerate launch` host a key-value store (`TORCHELASTIC_USE_AGENT_STORE`) that all
    ranks of all nodes reach: rank 0 puts its `${now:}`-style dir there, the others read it. An explicit
    `hydra.run.dir=...` or `SFT_RUN_DIR` is already the same on every rank and is left alone.
    """
    if world_size() == 1 or os.environ.get("SFT_RUN_DIR"):
        return
    if any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        print("error: a multi-process run outside torchrun/accelerate launch needs one run dir for all ranks: "
              "set SFT_RUN_DIR or hydra.run.dir", file=sys.stderr)
        sys.exit(2)
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(minutes=10))
    key = "sft/run_dir"
    if is_rank_zero() and not store.check([key]):
        store.set(key, time.strftime("outputs/%Y-%m-%d/%H-%M-%S"))
    os.environ["SFT_RUN_DIR"] = store.get(key).decode()


def rank_overrides() -> list[str]:
    """Ranks other than 0 write no `.hydra/` and no log file, and log warnings only, to the console."""
    if is_rank_zero():
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.job_logging.root.level=WARNING"]


def end_process_group() -> None:
    """Tear the process group down together at the end of a run.

    Exiting with it alive can abort a rank at interpreter shutdown ("terminate called without an active
    exception") while its peers are still writing results.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_without_teardown() -> None:
    """End the process of a finished run (`python -m sft.train`, each rank of a launch) without the interpreter's
    teardown of the ~4,000 modules torch, transformers and peft import: about 1 s of a short run's 6 (measured,
    `python -m sft.bench 'bench.cases=[startup]'`). Everything the run writes is closed by then (checkpoints, the
    model, results.json, the trackers); the `atexit` handlers still run (logging's flush and close,
    multiprocessing's, W&B's), then the standard streams are flushed. Where another non-daemon thread is alive,
    the interpreter's own exit waits for it instead."""
    import atexit
    import threading

    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_threads(cores: int, local_processes: int, omp_num_threads: str | None) -> int | None:
    """Torch's intra-op threads for each of `local_processes` training processes on `cores` CPU cores, or
    None to leave torch's choice. `OMP_NUM_THREADS` is the user's to set, except the 1 that torchrun and
    accelerate set for every multi-process launch, which would leave all but `local_processes` cores idle.

        cores=16, local_processes=2, OMP_NUM_THREADS="1" (torchrun's)  ->  8
        cores=2,  local_processes=1, unset  ->  None (torch uses the 2 cores)
    """
    if omp_num_threads is not None and not (omp_num_threads == "1" and local_processes > 1):
        return None
    if local_processes <= 1:
        return None
    return max(1, cores // local_processes)


def set_cpu_threads(log) -> None:
    """Without a GPU, give each training process its share of the cores (`cpu_threads`) and an allocator that reuses
    freed memory (`reuse_freed_memory`), and warn once when the load average says other work already uses the
    cores: torch's CPU kernels slow down many times over when their threads have to share cores."""
    import torch

    if torch.cuda.is_available():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = cpu_threads(cores, local, os.environ.get("OMP_NUM_THREADS"))
    if threads is not None:
        torch.set_num_threads(threads)
    reuse_freed_memory()
    if not is_local_rank_zero():
        return
    log.info("cpu: %d torch thread(s) per process, %d process(es) on %d core(s)", torch.get_num_threads(), local,
             cores)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > cores:
        log.warning("cpu: the load average (%.1f) is above the %d core(s) this run uses: other work shares them, "
                    "and torch's CPU threads then slow down badly; training will be slower than the machine "
                    "allows until it ends (or set OMP_NUM_THREADS lower)", load, cores)


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit systems
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX = -1, -3, 32 << 20


def reuse_freed_memory() -> bool:
    """On a CPU, let glibc's allocator reuse the memory of freed tensors at the next step: by default each block of
    128 KiB to 32 MiB (activations, logits) is mapped fresh from the system and unmapped when freed (the threshold
    adapts only now and then), and every first touch of a fresh page faults. Measured with the bench's model
    (64 rows a step): 480,000-640,000 page faults in 35 steps, 1.5 s of system time in 10 s, and down to 0-16,000
    faults with this. True where glibc took the settings (not on other C libraries, not with `MALLOC_MMAP_THRESHOLD_`
    set by the user)."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # blocks up to 32 MiB from the heap, and the heap's top kept (up to 1 GiB) rather than trimmed after each step
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
