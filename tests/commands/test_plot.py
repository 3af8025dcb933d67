"""`sft plot`: runs overlaid in one picture from their metrics.jsonl; a sweep's dir stands for its jobs."""

import json

import pytest

from sft.commands.plot import main, runs_of


def write_run(path, losses):
    path.mkdir(parents=True)
    lines = [{"step": i + 1, "loss": loss, "learning_rate": 1e-3, "grad_norm": 1.0} for i, loss in enumerate(losses)]
    lines.append({"step": len(losses), "eval_loss": losses[-1], "eval_loss_bucket_0": losses[-1] + 0.1})
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_sweep_dir_stands_for_its_jobs_and_the_picture_holds_every_run(tmp_path, capsys):
    write_run(tmp_path / "sweep" / "0", [3.0, 2.0, 1.0])
    write_run(tmp_path / "sweep" / "1", [3.0, 2.5, 2.0])
    write_run(tmp_path / "alone", [1.0, 0.5])
    runs = runs_of([str(tmp_path / "sweep"), str(tmp_path / "alone")])
    assert list(runs) == [str(tmp_path / "sweep" / "0"), str(tmp_path / "sweep" / "1"), str(tmp_path / "alone")]
    assert [m["loss"] for m in runs[str(tmp_path / "alone")] if "loss" in m] == [1.0, 0.5]
    main([str(tmp_path / "sweep"), str(tmp_path / "alone"), "-o", str(tmp_path / "all.png")])
    assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG" and "3 run(s)" in capsys.readouterr().out


def test_a_dir_with_no_run_is_one_line_and_exit_code_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: no metrics.jsonl here nor in its sub-dirs (a run dir of sft "
                                       "train, or a sweep's)\n")
