"""One run per run dir: a lock while a run uses it, and no new run over another run's outputs.

- `RunDirLock`: rank 0 holds `<run dir>/.sft.lock` (pid, host, start) from start to exit, so a second run
  given the same `hydra.run.dir` refuses to start instead of interleaving checkpoints with the first. A killed
  run's lock is removed by its sentinel (`sft.training.processes.sentinel`); one left all the same (the machine went
  down) by a process on this host is taken over; one held on another host is refused, naming it, unless it has not been
  refreshed for `LOCK_STALE_S` (a held lock is refreshed every `LOCK_HEARTBEAT_S`: a run killed with its sentinel, a
  container stopped, a requeue on another node).
- `claim`: a new run (no `resume`) into a dir holding another run's checkpoints or results is refused in
  one line naming that run, unless `overwrite=true` (which deletes those outputs first).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from sft.config.schema import ConfigError
from sft.ranks import is_rank_zero
from sft.training.processes.sentinel import guard

log = logging.getLogger("sft")

LOCK_FILE = ".sft.lock"
# What a run writes into its dir (besides Hydra's .hydra/ and log): what `overwrite=true` deletes.
RUN_OUTPUTS = ("checkpoint-*", "model", "results.json", "eval_initial.json", "eval_rows.jsonl", "rejected.jsonl",
               "nan_batches", "spikes", "hangs", "runs")
_YOUNG_LOCK_S = 10.0  # an empty lock file younger than this is being written (file systems without links)
MIN_FREE_BYTES = 16 * 2**20  # less than this free where a run would start: its disk is full
LOCK_HEARTBEAT_S = 30  # a held lock's time is refreshed this often
LOCK_STALE_S = 300.0  # a lock of another host not refreshed for this long is left by a run that is gone


def _start_ticks(pid: int) -> int | None:
    """When a process started (clock ticks since boot, /proc), to tell a reused pid from its first owner."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process a lock names still runs (on this host)."""
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    ticks = _start_ticks(int(holder["pid"]))
    return holder.get("start_ticks") is None or ticks is None or ticks == holder["start_ticks"]


class RunDirLock:
    """`<run dir>/.sft.lock` while this process runs in the dir (`acquire` ... `release`, also at exit)."""

    def __init__(self, run_dir: str | os.PathLike, key: str = "hydra.run.dir"):
        self.run_dir, self.key = str(run_dir), key
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise `ConfigError` naming the run that holds it."""
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _start_ticks(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._create(json.dumps(me) + "\n")
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as e:  # a read-only file system, no permission, a full disk
                raise ConfigError(self.key, self.run_dir, f"cannot be written ({e.strerror}: {self.path}); give a "
                                  "writable dir") from None
            self.held = True
            self._beat()
            atexit.register(self.release)
            guard("lock", self.path)  # released also after a SIGKILL, or an exit that runs no atexit
            return
        raise ConfigError(self.key, self.run_dir, f"could not take {self.path}: another run keeps taking it")

    def _create(self, text: str) -> None:
        """Create the lock file holding `text`, or raise FileExistsError. The text is written to a file of
        its own and hard-linked into place, so another run never reads a lock that is still empty."""
        draft = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        draft.write_text(text)
        try:
            os.link(draft, self.path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: exclusive create, then write
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        finally:
            draft.unlink(missing_ok=True)

    def _take_over_if_stale(self) -> None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return  # released meanwhile
        except (OSError, ValueError):
            holder = None
        if holder is None:  # being written now, or left half-written by a crash
            try:
                young = time.time() - self.path.stat().st_mtime < _YOUNG_LOCK_S
            except FileNotFoundError:
                return
            if young:
                raise ConfigError(self.key, self.run_dir, f"another run is starting in it ({self.path})")
        elif holder.get("host") != socket.gethostname() and self._silent_for() > LOCK_STALE_S:
            log.warning("run dir lock: %s was left by pid %s on %s, and not refreshed for %.0f s (a live run refreshes "
                        "it every %d s): taking it over", self.path, holder.get("pid"), holder.get("host"),
                        self._silent_for(), LOCK_HEARTBEAT_S)
            self.path.unlink(missing_ok=True)
            return
        elif holder.get("host") != socket.gethostname() or _alive(holder):
            raise ConfigError(
                self.key, self.run_dir,
                f"another run is using it: pid {holder.get('pid')} on {holder.get('host')} since "
                f"{holder.get('started')} (lock {self.path}; if that run is gone, delete the file). Two runs in "
                f"one dir would overwrite each other's files: give this one another {self.key}")
        log.warning("run dir lock: %s was left by %s, which no longer runs: taking it over", self.path,
                    f"pid {holder['pid']}" if holder else "a crashed start")
        self.path.unlink(missing_ok=True)

    def _beat(self) -> None:
        """Refresh the lock's time every `LOCK_HEARTBEAT_S` while it is held: a lock of another host that stopped
        being refreshed (its run, and its sentinel, killed together: a container stopped, a node gone) is stale."""
        import threading

        def beat():
            while self.held:
                time.sleep(LOCK_HEARTBEAT_S)
                if self.held:
                    with contextlib.suppress(OSError):
                        os.utime(self.path)

        threading.Thread(target=beat, name="sft-run-dir-lock", daemon=True).start()

    def _silent_for(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return float("inf")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def lock_run_dirs(run_dir: str, output_dir: str) -> list:
    """Rank 0 holds the run dir (and the checkpoint dir, if another) for the run (`RunDirLock`):
    a second run started into it refuses to start."""
    if not is_rank_zero():
        return []
    locks = []
    try:
        folders = [(run_dir, "hydra.run.dir")] + ([(output_dir, "trainer.output_dir")] if output_dir != run_dir else [])
        for folder, key in folders:
            locks.append(RunDirLock(folder, key))
            locks[-1].acquire()
    except ConfigError:
        for lock in locks:
            lock.release()
        raise
    return locks


def run_outputs(run_dir: str | os.PathLike) -> list[Path]:
    """What earlier runs left in a run dir (`RUN_OUTPUTS`)."""
    root = Path(run_dir)
    return sorted({p for pattern in RUN_OUTPUTS for p in root.glob(pattern)}) if root.is_dir() else []


def config_hash(config: dict) -> str:
    """A short hash of a resolved config, to tell runs apart in messages."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def describe_run(run_dir: str | os.PathLike) -> str:
    """The run whose outputs a dir holds, in a few words: its newest checkpoint and config hash, or its
    results."""
    from sft.training.checkpoints.store import checkpoints, read_state

    found = [(step, path) for step, path, complete in checkpoints(run_dir) if complete]
    for step, path in reversed(found):
        try:
            state = read_state(path)
        except (OSError, ValueError):
            continue
        run = f"run {state['run_id']}, " if state.get("run_id") else ""
        return f"{path.name} ({run}config {config_hash(state.get('config', {}))}, step {step})"
    results = Path(run_dir, "results.json")
    if results.is_file():
        try:
            status = json.loads(results.read_text()).get("status", "ok")
        except (OSError, ValueError):
            status = "unreadable"
        return f"results.json (status {status})"
    outputs = run_outputs(run_dir)
    return ", ".join(p.name for p in outputs[:3]) + (" ..." if len(outputs) > 3 else "")


def claim_sweep_dir(sweep_dir: str, resume: bool) -> RunDirLock | None:
    """A sweep holds its dir for as long as it runs (`RunDirLock`: a second sweep started into it refuses, naming
    the first), and a new sweep (no `sweep.resume`) does not start in a dir holding another sweep's jobs: their
    records, logs and results would be overwritten by this one's, and the report mix the two. None where the dir
    is Hydra's to name (`${now:...}`: a new one every time)."""
    if "${" in sweep_dir:
        return None
    jobs = sorted(p.name for p in Path(sweep_dir).glob("[0-9]*") if p.is_dir() and p.name.isdigit() and any(
        (p / name).is_file() and not (p / name).is_symlink()  # a planted link is no job's record (it is removed)
        for name in ("sweep_job.json", "results.json", ".hydra/config.yaml")))
    if jobs and not resume:
        raise ConfigError("hydra.sweep.dir", sweep_dir, f"holds another sweep's jobs ({len(jobs)}: {', '.join(jobs[:5])}"
                          f"{' ...' if len(jobs) > 5 else ''}): sweep.resume=true continues that sweep; another "
                          "hydra.sweep.dir starts a new one beside it")
    lock = RunDirLock(sweep_dir, "hydra.sweep.dir")
    lock.acquire()
    return lock


def claim(run_dir: str | os.PathLike, overwrite: bool, sweep_job: bool = False) -> None:
    """A new run (no `resume`) starts only in a dir without another run's outputs; `overwrite` deletes them
    (on rank 0) instead of refusing. `sweep_job`: the dir is a job's of a multirun, whose choices differ."""
    outputs = run_outputs(run_dir)
    if not outputs:
        return
    if not overwrite:
        choices = ("sweep.resume=true continues that sweep; another hydra.sweep.dir starts a new one beside it"
                   if sweep_job else "resume=auto continues it; another hydra.run.dir starts a new run beside it")
        raise ConfigError("hydra.sweep.dir" if sweep_job else "hydra.run.dir", str(run_dir),
                          f"holds another run: {describe_run(run_dir)}. {choices}; overwrite=true deletes its "
                          "checkpoints and results and starts over")
    if is_rank_zero():
        log.warning("overwrite=true: deleting what an earlier run left in %s: %s", run_dir,
                    ", ".join(p.name for p in outputs))
        for path in outputs:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def given_dirs(argv: list[str]) -> dict[str, str]:
    """The dirs a command line writes to, by the knob that names them: the run (or sweep) dir, as given or from
    `SFT_RUN_DIR` (else where Hydra's default puts it), and `trainer.output_dir` where set."""
    multirun = bool({"-m", "--multirun"} & set(argv))
    given = dict(a.lstrip("+").split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
    run_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    folders = {run_key: given.get(run_key) or os.environ.get("SFT_RUN_DIR") or ("multirun" if multirun else "outputs")}
    if given.get("trainer.output_dir") not in (None, "null"):
        folders["trainer.output_dir"] = given["trainer.output_dir"]
    return {key: folder.strip("'\"") for key, folder in folders.items() if "${" not in folder}  # else Hydra resolves


def unwritable_dir(argv: list[str]) -> ConfigError | None:
    """A dir of the command line that cannot be written (a read-only file system, no permission), as the error
    naming its knob: before Hydra fails on it with a traceback (its log file, `.hydra/`) or the lock does."""
    import tempfile

    for key, folder in given_dirs(argv).items():
        existing = Path(folder).absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            return ConfigError(key, folder, f"cannot be written ({e.strerror}: {existing}); give a writable dir")
        free = shutil.disk_usage(existing).free
        if free < MIN_FREE_BYTES:  # Hydra's first write (.hydra/config.yaml, the log) would fail with a traceback
            return ConfigError(key, folder, f"its disk is full ({free / 2**20:.1f} MiB free at {existing}): free space, "
                               "or give a dir on another disk")
    return None


# What Hydra writes into a run dir before any code of the run runs, and the run's own folders written file by file
PLANTABLE = (".hydra", "train.log", "runs", "hangs", "nan_batches", "spikes", "model")
# the files a run or a sweep writes at the top of its dir (a sweep: also into each job's dir)
WRITTEN = ("results.json", "eval_rows.jsonl", "eval_initial.json", "rejected.jsonl", "sweep_job.json",
           "sweep_summary.md", "sweep_summary.csv", "sweep_summary.png", "sweep_jobs.csv", "multirun.yaml")


def unlink_planted(argv: list[str]) -> None:
    """Remove symlinks where a run given an existing dir writes its own files: its files and dirs (`PLANTABLE`,
    `WRITTEN`), whatever lies below those dirs (`.hydra/config.yaml`, `model/config.json`), and the same in each job
    dir of a sweep. A link there would have the run write through it, into whatever it points at; the run writes its
    own files instead."""
    for folder in given_dirs(argv).values():
        folder = Path(folder)
        jobs = [p for p in folder.iterdir() if p.name.isdigit() and p.is_dir() and not p.is_symlink()] \
            if folder.is_dir() and not folder.is_symlink() else []
        for place in (folder, *jobs):
            for name in PLANTABLE + WRITTEN:
                _unlink_links(Path(place, name))


def _unlink_links(path: Path) -> None:
    """Remove `path` where it is a symlink, else every symlink below it (a dir's, walked without following links)."""
    if path.is_symlink():
        target = os.readlink(path)
        path.unlink()
        log.warning("run dir: %s was a symlink (to %s): removed it; the run writes its own files there", path, target)
    elif path.is_dir():
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                if Path(root, name).is_symlink():
                    _unlink_links(Path(root, name))
