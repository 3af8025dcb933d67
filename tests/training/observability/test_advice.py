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


def test_a_parameter_ddp_found_unused_is_one_line_naming_the_knob(tmp_path, monkeypatch):
    """A model whose forward leaves a trainable part without a gradient, under DDP without the search for unused
    parameters (sft's default for a dense text model): torch's own error, met in a real DDP step, becomes one line
    naming `trainer.ddp_find_unused_parameters`."""
    import torch
    import torch.distributed as dist

    from conftest import free_port
    from sft.config.schema import ConfigError
    from sft.training.observability.advice import train_with_advice

    class HalfUsed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    class Trainer:
        args = namedtuple("args", "ddp_find_unused_parameters output_dir")(False, str(tmp_path))

        def train(self, resume_from_checkpoint=None):
            model = torch.nn.parallel.DistributedDataParallel(HalfUsed(), find_unused_parameters=False)
            for _ in range(2):
                model(torch.ones(1, 2)).sum().backward()

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"^trainer.ddp_find_unused_parameters=False: some trainable parameters "
                           r".*set trainer.ddp_find_unused_parameters=true"):
            train_with_advice(Trainer(), cfg=None, checkpoint=None)
    finally:
        dist.destroy_process_group()
