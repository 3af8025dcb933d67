"""What a failed run says (`sft.training.observability.advice`): a write stopped by the process's file-size limit is
named so, not a full disk; a run dir on a full disk is refused before Hydra writes into it; a report that cannot be
written is one line and a failing exit code."""

import errno
from collections import namedtuple

import pytest


def test_a_file_size_limit_is_told_from_a_full_disk(tmp_path, monkeypatch):
    import resource

    from sft.training.observability.advice import disk_full, disk_full_message

    assert disk_full(OSError(errno.EFBIG, "File too large"))
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8 * 2**20, resource.RLIM_INFINITY))
    message = disk_full_message(str(tmp_path), "checkpoint-4")
    assert message.startswith(f"writing checkpoint-4 in {tmp_path} stopped at this process's file-size limit "
                              "(ulimit -f: 8 MiB a file), not a full disk (")
    assert "raise the limit (ulimit -f unlimited), then run again with resume=auto" in message


def test_a_run_dir_on_a_full_disk_is_refused_before_hydra_writes(tmp_path, monkeypatch):
    import shutil

    from sft.training.checkpoints.run_dir import unwritable_dir

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12, 300 * 1024))
    error = unwritable_dir([f"hydra.run.dir={tmp_path}/run"])
    assert str(error) == (f"hydra.run.dir='{tmp_path}/run': its disk is full (0.3 MiB free at {tmp_path}): free space, "
                          "or give a dir on another disk")


def test_a_report_the_disk_cannot_hold_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    import sft.commands.report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "sweep_summary.png"))

    monkeypatch.setattr(sft.commands.report, "write_report", full)
    with pytest.raises(SystemExit) as exited:
        sft.commands.report.main([str(tmp_path)])
    assert exited.value.code == 1
    assert capsys.readouterr().err == (f"error: the report cannot be written into {tmp_path}: No space left on device "
                                       f"({tmp_path / 'sweep_summary.png'})\n")
