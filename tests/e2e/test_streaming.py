"""`data.streaming=true` (`sft.data.splits.streaming`): rows read, labelled and weighed as they train; the same steps as the
rows read whole in order; killed mid-epoch and resumed, the rows after the checkpoint are the uninterrupted run's
(one process, and two processes each reading its own file); bad rows named by file and line."""

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, SMALL_EVAL, launch, run_train, step_losses

# Each optimizer step's rows, as the trainer fetches them, into $ROWS_SEEN.<rank> (one JSON line a step).
RECORD_ROWS = """
import json, os
from sft.training.controllers.base import Controller
from sft.training.trainer import WeightedLossTrainer

_get_batch_samples = WeightedLossTrainer.get_batch_samples

def get_batch_samples(self, epoch_iterator, num_batches, device):
    batches, denominator = _get_batch_samples(self, epoch_iterator, num_batches, device)
    if batches:
        rows = [[int(s), int(l), int(v)] for b in batches for s, l, v in zip(
            b.get("source_ids", [0] * len(b["source_lines"])), b["source_lines"], b["source_views"])]
        with open(os.environ["ROWS_SEEN"] + "." + os.environ.get("RANK", "0"), "a") as f:
            f.write(json.dumps({"step": self.state.global_step + 1, "rows": rows}) + "\\n")
    return batches, denominator

WeightedLossTrainer.get_batch_samples = get_batch_samples


class RecordRows(Controller):  # named in the config so that this module is imported in the run
    name = "record_rows"
"""

SIGKILL_AT_STEP = """
import os, signal
from sft.training.controllers.base import Controller

class SigkillAt(Controller):
    name = "sigkill_at"

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
"""

COMMON = ["trainer.max_steps=6", "trainer.save_steps=3", "trainer.logging_steps=1", "trainer.eval_steps=100",
          "trainer.report_to=[]", f"data.eval_file={SMALL_EVAL}", "trainer.per_device_train_batch_size=8",
          "loss=keywords", "loss.alpha=1", "data.packing=true"]


def rows_seen(path: Path, rank: int = 0) -> dict[int, list]:
    """Step -> the rows trained in it, from the record (the last record of a step wins: a resumed run's)."""
    seen = {}
    for line in Path(f"{path}.{rank}").read_text().splitlines():
        record = json.loads(line)
        seen[record["step"]] = record["rows"]
    return seen


RECORDED = "+controllers.rows={_target_:my_plugins.RecordRows}"


def plugins(tmp_path) -> dict:
    (tmp_path / "my_plugins.py").write_text(RECORD_ROWS + SIGKILL_AT_STEP)
    return {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.slow
def test_a_stream_trains_the_steps_of_the_rows_read_whole_in_order(tmp_path):
    """Packed rows with keyword token weights and difficulty weights: the same step losses as the map-style split
    in file order."""
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    a = run_train(*COMMON, "data.streaming=true", f"hydra.run.dir={streamed}")
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_train(*COMMON, "trainer.train_sampling_strategy=sequential", f"hydra.run.dir={whole}")
    assert b.returncode == 0, b.stderr[-3000:]
    assert step_losses(streamed, 6) == pytest.approx(step_losses(whole, 6), abs=1e-6)
    assert "train streamed" in (streamed / "train.log").read_text()


def mixture(tmp_path) -> list[str]:
    """Two sources drawn 0.7 / 0.3 (the second a Parquet file of the sample's other rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()[2000:2400]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "other.parquet")
    return ["data=mixture", "data.eval_file=null", f"data.mixture=[{{train_file: {REPO}/sft/sample_data/train.jsonl, "
            f"ratio: 0.7}}, {{train_file: {tmp_path}/other.parquet, ratio: 0.3, loss_weight: 2}}]"]


@pytest.mark.slow
@pytest.mark.parametrize("sources", ["one", "mixture"])
def test_a_stream_killed_mid_epoch_resumes_at_the_next_row(tmp_path, sources):
    """Killed (SIGKILL) in step 5, resumed from checkpoint-3: steps 4-6 train the rows the uninterrupted run trained
    there, with its losses; the stream is not read again from its start, nor re-tokenised up to its position. A
    mixture's draw goes on as it would have."""
    env = plugins(tmp_path)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    drawn = mixture(tmp_path) if sources == "mixture" else []
    done = run_train(*COMMON, *drawn, "data.streaming=true", RECORDED, f"hydra.run.dir={whole}",
                     env={**env, "ROWS_SEEN": str(tmp_path / "whole-rows")})
    assert done.returncode == 0, done.stderr[-3000:]
    if sources == "mixture":
        drawn_from = {s for step in rows_seen(tmp_path / "whole-rows").values() for s, _, _ in step}
        assert drawn_from == {0, 1}
    args = [*COMMON, *drawn, "data.streaming=true", RECORDED, f"hydra.run.dir={killed}"]
    lost = run_train(*args, "+controllers.kill={_target_:my_plugins.SigkillAt,step:5}",
                     env={**env, "ROWS_SEEN": str(tmp_path / "killed-rows")})
    assert lost.returncode != 0 and (killed / "checkpoint-3" / "sft_state.json").exists()
    assert sorted(rows_seen(tmp_path / "killed-rows")) == [1, 2, 3, 4, 5]
    resumed = run_train(*args, "resume=auto", env={**env, "ROWS_SEEN": str(tmp_path / "killed-rows")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    seen, expected = rows_seen(tmp_path / "killed-rows"), rows_seen(tmp_path / "whole-rows")
    assert seen == expected and len({tuple(r) for step in expected.values() for r in step}) == 6 * 8
    assert step_losses(killed, 6) == pytest.approx(step_losses(whole, 6), abs=1e-6)


@pytest.mark.slow
def test_two_processes_stream_a_file_each_and_resume_at_the_next_row(tmp_path):
    """Two files, two processes: each rank reads its own file (split by file), killed in step 5 and resumed with two
    processes: each rank's rows are the uninterrupted run's, step for step."""
    rows = (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()
    for k in (0, 1):
        (tmp_path / f"part-{k}.jsonl").write_text("\n".join(rows[k * 200:(k + 1) * 200]) + "\n")
    env = plugins(tmp_path)
    common = ["--nproc", "2", *COMMON, "data.streaming=true", RECORDED, f"data.train_file={tmp_path}/part-*.jsonl"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = launch(*common, f"hydra.run.dir={whole}", env={**env, "ROWS_SEEN": str(tmp_path / "whole-rows")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(by file over 2 rank(s))" in (whole / "train.log").read_text()
    lost = launch(*common, f"hydra.run.dir={killed}", "+controllers.kill={_target_:my_plugins.SigkillAt,step:5}",
                  env={**env, "ROWS_SEEN": str(tmp_path / "killed-rows")})
    assert lost.returncode != 0 and (killed / "checkpoint-3" / "sft_state.json").exists()
    resumed = launch(*common, f"hydra.run.dir={killed}", "resume=auto",
                     env={**env, "ROWS_SEEN": str(tmp_path / "killed-rows")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        assert rows_seen(tmp_path / "killed-rows", rank) == rows_seen(tmp_path / "whole-rows", rank)
    first = {line for step in rows_seen(tmp_path / "whole-rows", 0).values() for _, line, _ in step}
    assert max(first) <= 200  # rank 0 trained on lines of its own file only (each file's lines count from 1)
    assert step_losses(killed, 6) == pytest.approx(step_losses(whole, 6), abs=1e-5)
    refused = launch("--nproc", "1", *common[2:], f"hydra.run.dir={killed}", "resume=auto", "trainer.max_steps=8",
                     env={**env, "ROWS_SEEN": str(tmp_path / "refused-rows")})
    assert refused.returncode == 2 and "streaming its data, this run has 1" in refused.stderr


@pytest.mark.slow
def test_a_bad_row_in_a_stream_is_named_by_file_and_line_or_skipped_and_counted(tmp_path):
    rows = (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()[:100]
    rows[40] = '{"messages": [{"role": "user", "content": "hi"}]}'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    args = ["data.streaming=true", f"data.train_file={bad}", "trainer.max_steps=8", "trainer.eval_steps=100",
            "trainer.save_steps=100", "trainer.per_device_train_batch_size=8", "loss=ce"]
    stopped = run_train(*args, f"hydra.run.dir={tmp_path / 'a'}")
    assert stopped.returncode == 2
    assert stopped.stderr.strip().splitlines()[-2:] == [
        "error: 1 bad row(s) in the data:", f"  {bad}:41: messages: no assistant turn (nothing to train on)"], \
        stopped.stderr
    skipped = run_train(*args, "data.on_error=skip", f"hydra.run.dir={tmp_path / 'b'}")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert f"data: skipped {bad}:41: messages: no assistant turn (nothing to train on)" in \
        (tmp_path / "b" / "train.log").read_text()


def test_what_a_stream_cannot_do_is_refused_in_one_line(tmp_path):
    no_steps = run_train("data.streaming=true", f"hydra.run.dir={tmp_path / 'a'}")
    assert no_steps.returncode == 2 and "data.streaming=True: a stream has no length: set trainer.max_steps" in \
        no_steps.stderr
    curriculum = run_train("data.streaming=true", "trainer.max_steps=2", "+controllers=curriculum",
                           f"hydra.run.dir={tmp_path / 'b'}")
    assert curriculum.returncode == 2 and "controllers.curriculum chooses the rows it trains on" in curriculum.stderr
