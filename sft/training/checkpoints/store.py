"""Checkpoints that are complete or invisible, carrying the project's own state.

Trainer writes `checkpoint-N/` in place, so a crash can leave half of one that `get_last_checkpoint`
(which goes by name) would pick. Here every checkpoint gets `sft_state.json` last, by rank 0, once all
ranks have finished writing: it is the completion marker, and it holds what a resume needs beyond
Trainer's own files (the resolved config, the data identity, the package version and git commit, and
the state of every controller). `resume=auto` picks the newest checkpoint that has it; rotation keeps the
newest `save_total_limit` complete ones plus the best one and the one this run resumed from.

The marker also lists every file of the checkpoint (every rank's) with its size and a CRC-32 (`manifest`;
with `checkpoint_checksums=small` only files up to 64 MiB get one). A resume verifies them (`verify`, the files
read in parallel: disk-bound, about 3 GB/s from the page cache): `resume=auto` passes over a newest checkpoint
that lost or changed a file, naming it, to the next one that is whole; an explicit `resume=<dir>` that fails is
refused (`resume_force=true` overrides).

Before Trainer writes a checkpoint, rank 0 creates it with `WRITING_FILE` in it (`start_checkpoint`): a dir
with that marker and no `sft_state.json` is this run's crash debris, which `resume=auto` deletes. A
`checkpoint-N` with neither (copied in from a plain Trainer run, say) was not written here: it is renamed
`checkpoint-N.foreign`, never deleted (`set_aside_foreign`).

A checkpoint dir is deleted (rotation, crash debris) by first renaming it `checkpoint-N.deleting-<pid>`, a name no
resume reads, then removing it (`delete_dir`): a kill in the middle leaves that name, whose removal the next start
finishes (`finish_deletes`), never a `checkpoint-N` missing some of its files (which a resume would set aside as
foreign, and keep for ever).

A resume from step N renames the dir's checkpoints after N (damaged ones that `resume=auto` passed over,
or a later branch left by `resume=<older checkpoint>`) to `checkpoint-M.damaged` / `.abandoned`: kept
for the user, never resumed from, rotated or written into (`set_aside_after`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from sft.config.schema import ConfigError
from sft.files import write_text
from sft.ranks import is_rank_zero

log = logging.getLogger("sft")

STATE_FILE = "sft_state.json"
WRITING_FILE = ".sft-writing"  # in a checkpoint dir from before Trainer writes it until sft_state.json is written
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
SMALL_FILE = 64 * 2**20  # files up to this size get a checksum in the manifest


def checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) of every `checkpoint-N` dir, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [(step, p, (p / STATE_FILE).is_file()) for step, p in sorted(found)]


def latest_complete(output_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose completion marker was written."""
    complete = [p for _, p, ok in checkpoints(output_dir) if ok]
    return complete[-1] if complete else None


def start_checkpoint(folder: str | os.PathLike) -> None:
    """Mark `folder` as being written by sft (before Trainer writes into it); a planted symlink there is removed,
    so that nothing is written through it."""
    folder = Path(folder)
    if folder.is_symlink():
        log.warning("checkpoint: %s is a symlink, not a checkpoint of this run: removed it", folder)
        folder.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WRITING_FILE).write_text(f"{os.getpid()}\n")


def crash_debris(checkpoint: Path) -> bool:
    """Whether an incomplete checkpoint dir is sft's own, left by a crash while writing it."""
    return (checkpoint / WRITING_FILE).is_file()


DELETING = ".deleting-"  # a checkpoint dir being deleted: `checkpoint-N.deleting-<pid>` (`delete_dir`)


def delete_dir(path: Path) -> None:
    """Delete a checkpoint dir so that no kill can leave half of it under its own name: renamed first (atomic: the dir
    is whole under its name, or under a name no resume reads), then removed."""
    doomed = path.with_name(f"{path.name}{DELETING}{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def finish_deletes(output_dir: str | os.PathLike) -> list[Path]:
    """Finish the deletes a kill interrupted (`delete_dir`'s renamed dirs left behind); return them."""
    root = Path(output_dir)
    left = sorted(p for p in root.iterdir() if p.is_dir() and DELETING in p.name) if root.is_dir() else []
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


def remove_incomplete(output_dir: str | os.PathLike) -> list[Path]:
    """Delete sft's checkpoint dirs that have no completion marker (left by a crash); return them. A dir that
    sft did not write is left alone (`set_aside_foreign`)."""
    removed = [p for _, p, ok in checkpoints(output_dir) if not ok and crash_debris(p)]
    for p in removed:
        delete_dir(p)
    return removed


def set_aside_foreign(output_dir: str | os.PathLike) -> list[Path]:
    """Rename `checkpoint-N` dirs that sft did not write (no `sft_state.json`, no `WRITING_FILE`: a plain
    Trainer's, copied in) to `checkpoint-N.foreign`: kept, but never resumed from, rotated or written into."""
    moved = []
    for _, path, complete in checkpoints(output_dir):
        if not complete and not crash_debris(path):
            target = _free_name(path, "foreign")
            path.rename(target)
            moved.append(target)
    return moved


def _free_name(path: Path, suffix: str) -> Path:
    target, n = path.with_name(f"{path.name}.{suffix}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{suffix}-{n}")
    return target


def read_state(checkpoint: str | os.PathLike) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def crc32(path: Path) -> int:
    """The CRC-32 of a file's bytes, read 16 MiB at a time (about 1 GB/s)."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            value = zlib.crc32(chunk, value)
    return value


def crc32_all(paths: list[Path]) -> list[int]:
    """The CRC-32 of each file, several files at once: reading is the bound, and zlib releases the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    if len(paths) < 2:
        return [crc32(p) for p in paths]
    with ThreadPoolExecutor(min(4, len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(crc32, paths))


def manifest(folder: Path, checksum_all: bool = True) -> dict[str, dict]:
    """Every file of a checkpoint but the markers: its size and CRC-32 (with `checksum_all=False`, a CRC-32 for
    files up to `SMALL_FILE` only)."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (STATE_FILE, WRITING_FILE))
    files = {path.relative_to(folder).as_posix(): {"size": path.stat().st_size} for path in paths}
    summed = [p for p in paths if checksum_all or p.stat().st_size <= SMALL_FILE]
    for path, value in zip(summed, crc32_all(summed)):
        files[path.relative_to(folder).as_posix()]["crc32"] = value
    return files


def verify(checkpoint: str | os.PathLike) -> str | None:
    """Why a complete checkpoint cannot be resumed from (the file and what is wrong with it), or None."""
    folder = Path(checkpoint)
    try:
        files = read_state(folder).get("files")
    except (OSError, ValueError) as e:
        return f"{STATE_FILE}: unreadable ({type(e).__name__}: {e})"
    files = files or {}  # a checkpoint of an older sft lists none
    for name, saved in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name}: missing"
        if path.stat().st_size != saved["size"]:
            return f"{name}: {path.stat().st_size} bytes, {saved['size']} when saved"
    summed = [name for name, saved in files.items() if "crc32" in saved]
    for name, value in zip(summed, crc32_all([folder / name for name in summed])):
        if value != files[name]["crc32"]:
            return f"{name}: its bytes changed since it was saved (CRC-32)"
    return None


def set_aside_after(output_dir: str | os.PathLike, step: int, damaged: dict[Path, str]) -> None:
    """Rename the dir's checkpoints after `step` (the one resumed from; 0 for a fresh start) so that the
    resumed run neither resumes from them, rotates them nor writes into them: `.damaged` for those in
    `damaged` (path -> the problem), `.abandoned` for the others (a later branch)."""
    if not is_rank_zero():
        return
    for later, path, complete in checkpoints(output_dir):
        if later <= step or not complete:  # incomplete ones are crash debris, removed by find_checkpoint
            continue
        target = _free_name(path, "damaged" if path in damaged else "abandoned")
        path.rename(target)
        log.warning("resume: %s is after the checkpoint resumed from (step %d)%s: renamed %s, kept but never used",
                    path, step, f" and {damaged[path]}" if path in damaged else "", target.name)


def step_of(checkpoint: str | os.PathLike) -> int:
    """The step in a checkpoint dir's name (`checkpoint-N`), or 0 for a dir named otherwise."""
    m = _CHECKPOINT.match(Path(checkpoint).name)
    return int(m.group(1)) if m else 0


def inside(checkpoint: str | os.PathLike | None, output_dir: str | os.PathLike) -> bool:
    """Whether a checkpoint is one of `output_dir`'s own."""
    return checkpoint is not None and Path(checkpoint).resolve().parent == Path(output_dir).resolve()


def deepspeed_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Whether a checkpoint holds DeepSpeed's engine state (`latest`, `global_step*/`), which DeepSpeed loads
    with `torch.load(weights_only=False)`: unpickling it runs whatever code its files contain."""
    folder = Path(checkpoint)
    return (folder / "latest").is_file() or any(folder.glob("global_step*"))


def written_record(checkpoint: str | os.PathLike) -> Path:
    """Where this user's sft records the DeepSpeed checkpoints it wrote: in the sft cache (`$SFT_CACHE`, private to
    the user), by the checkpoint's absolute path; never in the run dir, which others may write into."""
    from sft.cache import cache_dir

    key = hashlib.sha256(str(Path(checkpoint).resolve()).encode()).hexdigest()[:24]
    return cache_dir() / "written-checkpoints" / f"{key}.json"


def _file_identities(folder: Path) -> dict[str, list[int]]:
    """Each file of a checkpoint (but the markers) as (inode, size, ctime): what changes when a file is replaced or
    rewritten, even with its times set back (a change time cannot be set)."""
    return {p.relative_to(folder).as_posix(): [p.stat().st_ino, p.stat().st_size, p.stat().st_ctime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (STATE_FILE, WRITING_FILE)}


def record_written(folder: Path) -> None:
    """Record a DeepSpeed checkpoint this process just wrote (`written_by_us` reads the record)."""
    record = written_record(folder)
    record.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_text(record, json.dumps({"checkpoint": str(folder.resolve()), "files": _file_identities(folder)}) + "\n")


def written_by_us(checkpoint: str | os.PathLike) -> bool:
    """Whether every file of a DeepSpeed checkpoint is the one this user's sft wrote there (no file added, replaced
    or rewritten since): the trust DeepSpeed's unpickling needs, from a record outside the run dir."""
    try:
        record = json.loads(written_record(checkpoint).read_text())
    except (OSError, ValueError):
        return False
    return record.get("files") == _file_identities(Path(checkpoint))


UNTRUSTED = ("a DeepSpeed checkpoint this user's sft has no record of writing (none in its cache, or a file added, "
             "replaced or rewritten since): DeepSpeed unpickles its files, which runs any code in them (a checkpoint "
             "is code, like a model with remote code); trust_checkpoint=true if you trust whoever made it")


def find_checkpoint(resume: str | None, output_dir: str, force: bool, trust: bool = False) -> str | None:
    """The checkpoint to resume from: none, the newest complete one in the run dir (`auto`), or a path.

    Checkpoints of the run dir after the one chosen are renamed aside (`set_aside_after`),
    so that the resumed run never writes into them, nor rotates them away. An explicit DeepSpeed checkpoint
    from elsewhere is refused unless `trust` (its pickles run code; its manifest can be forged by its maker).
    """
    if resume is None:
        return None
    if resume == "auto":
        found, damaged = None, {}
        for _, path, complete in reversed(checkpoints(output_dir)):
            problem = verify(path) if complete else None
            if complete and problem is None and deepspeed_checkpoint(path) and not trust and not written_by_us(path):
                problem = UNTRUSTED
            if complete and problem is None:
                found = path
                break
            if problem:
                damaged[path] = problem
                log.warning("resume=auto: passing over %s: %s", path, problem)
        if is_rank_zero():
            for left in finish_deletes(output_dir):
                log.warning("resume=auto: finished deleting %s (a checkpoint rotation was stopped while deleting it)",
                            left)
            for debris in remove_incomplete(output_dir):
                log.warning("resume=auto: removed %s, a checkpoint left incomplete by a crash", debris)
            for foreign in set_aside_foreign(output_dir):
                log.warning("resume=auto: %s has no %s (not a checkpoint sft wrote, or one an older sft "
                            "left incomplete): renamed %s, kept but never resumed from (resume=%s resume_force=true resumes "
                            "from it)", foreign.with_suffix(""), STATE_FILE, foreign.name, foreign)
        set_aside_after(output_dir, step_of(found) if found else 0, damaged)
        log.info("resume=auto: %s",
                 f"resuming from {found}" if found else f"no checkpoint in {output_dir}, starting fresh")
        return str(found) if found else None
    if deepspeed_checkpoint(resume) and not trust and not written_by_us(resume):
        raise ConfigError("resume", resume, UNTRUSTED)
    if not Path(resume, STATE_FILE).is_file() and not force:
        raise ConfigError("resume", resume, f"no {STATE_FILE}: an incomplete checkpoint, or not one of sft's "
                          "(resume_force=true resumes anyway)")
    problem = verify(resume) if Path(resume, STATE_FILE).is_file() else None
    if problem and not force:
        raise ConfigError("resume", resume, f"{problem}; an older checkpoint, or resume_force=true to resume anyway")
    if problem:
        log.warning("resume_force: resuming from %s although %s", resume, problem)
    if inside(resume, output_dir):
        if is_rank_zero():
            finish_deletes(output_dir)
        set_aside_after(output_dir, step_of(resume), {})
    return resume


def git_commit() -> str | None:
    """The commit of the source tree, when it is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def write_json_atomic(path: Path, payload: dict) -> None:
    write_text(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


class CheckpointState(TrainerCallback, ExportableState):
    """On each save: wait for every rank, write `sft_state.json` (the marker), rotate old checkpoints.

    `controllers` maps a name to any object with `state_dict()`; the data hash also goes into
    `trainer_state.json` (`stateful_callbacks.CheckpointState`) so a checkpoint names its data version. With a
    background writer (`writer`, `sft.training.checkpoints.sharded.ShardWriter`: `checkpoint.async_save`) the marker
    waits until every rank's shards are written: the state is taken at the save, the marker written at the first step
    end (or the next save, or the end of training) that finds the writes done on all ranks.
    """

    def __init__(self, run_info: dict, controllers: dict, keep: int | None, resumed_from: str | None,
                 checksum_all: bool = False, writer=None):
        self.run_info, self.controllers, self.keep, self.checksum_all = run_info, controllers, keep, checksum_all
        self.resumed_from = Path(resumed_from).resolve() if resumed_from else None
        self.run_id = run_info.get("run_id")
        self.writer = writer

    def state(self) -> dict:
        return {"args": {}, "attributes": {"data_hash": self.run_info["data_hash"]}}

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        payload = {**self.run_info, "global_step": state.global_step,
                   "controllers": {name: c.state_dict() for name, c in self.controllers.items()}}
        finish = lambda: self.complete(folder, payload, args.output_dir, state.best_model_checkpoint,  # noqa: E731
                                       state.is_world_process_zero)
        if self.writer is not None and self.writer.pending() == folder:
            self.writer.finish = finish  # the shards are still being written
        else:
            finish()

    def on_step_end(self, args, state, control, **kwargs):
        if self.writer is not None and self.writer.pending() is not None and self.writer.finished_everywhere():
            self.writer.wait()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.wait()

    def complete(self, folder: Path, payload: dict, output_dir: str, best: str | None, rank_zero: bool) -> None:
        """Once every rank's files are on disk: the marker with the manifest (rank 0), then the rotation."""
        from accelerate import PartialState

        PartialState().wait_for_everyone()  # every rank's shards are on disk before the marker
        if rank_zero:
            write_json_atomic(folder / STATE_FILE, {**payload, "files": manifest(folder, self.checksum_all)})
            (folder / WRITING_FILE).unlink(missing_ok=True)
            if deepspeed_checkpoint(folder):  # its pickles are trusted on resume by this record alone
                record_written(folder)
            self.rotate(output_dir, best)
        PartialState().wait_for_everyone()

    def rotate(self, output_dir: str, best: str | None) -> None:
        """Keep the newest `keep` complete checkpoints, the best one and the resumed one; drop the rest,
        if they are this run's (another run's checkpoints are never deleted)."""
        if self.keep is None:
            return
        found = checkpoints(output_dir)
        complete = [p for _, p, ok in found if ok]
        newest_step = max((s for s, _, ok in found if ok), default=-1)
        protected = set(complete[-self.keep:]) | {Path(b).resolve() for b in [best] if b}
        if self.resumed_from is not None:
            protected.add(self.resumed_from)
        for step, path, ok in found:
            if path.resolve() in {p.resolve() for p in protected}:
                continue
            if ok and not self.ours(path):
                continue
            if ok or (step < newest_step and crash_debris(path)):  # older, incomplete and ours: crash debris
                delete_dir(path)
                log.info("checkpoint rotation: removed %s", path)

    def ours(self, checkpoint: Path) -> bool:
        """Whether a complete checkpoint was saved by this run (or the run it resumes)."""
        try:
            return read_state(checkpoint).get("run_id") == self.run_id
        except (OSError, ValueError):
            return False
