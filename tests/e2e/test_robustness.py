"""Fault finding: poisoned rows, NaN steps on one rank, loss spikes, hangs, OOM, malformed data corpus."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, SMALL_EVAL, chat, free_port, log_history, run_patched, run_train, write_jsonl
from safetensors.torch import load_file

from sft import sample_data

POISON = """
POISON_LINES = set(map(int, os.environ["POISON_LINES"].split(",")))
SCALE = float(os.environ.get("POISON_SCALE", "nan"))  # nan: a poisoned row; a number: a row that spikes
from sft.training.trainer import WeightedLossTrainer
_compute = WeightedLossTrainer.compute_loss
def compute_loss(self, model, inputs, *args, **kwargs):
    lines = inputs.get("source_lines")
    rows = [i for i, line in enumerate(lines.tolist()) if line in POISON_LINES] if lines is not None else []
    handle = None
    if rows and model.training:  # the row's final hidden states, hence its logits, turn to NaN or blow up
        def hook(module, inp, out):
            hidden = out[0].clone()
            hidden[rows] = float("nan") if SCALE != SCALE else hidden[rows] * SCALE
            out.last_hidden_state = hidden
            return out
        handle = self.accelerator.unwrap_model(model).get_decoder().register_forward_hook(hook)
    try:
        return _compute(self, model, inputs, *args, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
WeightedLossTrainer.compute_loss = compute_loss
"""


# Rows in file order, 2 per step: step k trains on lines 2k-1 and 2k.
ORDERED = ["trainer.train_sampling_strategy=sequential", "trainer.per_device_train_batch_size=2",
           "trainer.save_steps=1", "trainer.save_total_limit=20", "trainer.logging_steps=1",
           "trainer.eval_steps=100", "trainer.lr_scheduler_type=linear", "trainer.warmup_steps=0",
           f"data.eval_file={SMALL_EVAL}"]


def patched(patch, env, *overrides):
    os.environ.update(env)
    try:
        return run_patched("import os\n" + patch, *overrides)
    finally:
        for k in env:
            os.environ.pop(k)


def same_params(a, b):
    pa, pb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return all((pa[k] == pb[k]).all() for k in pa)


@pytest.mark.slow
def test_a_poisoned_row_skips_its_step_and_is_named(tmp_path):
    proc = patched(POISON, {"POISON_LINES": "5"}, *ORDERED, "trainer.max_steps=5", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_params(tmp_path / "checkpoint-2", tmp_path / "checkpoint-3")  # step 3 changed nothing
    assert not same_params(tmp_path / "checkpoint-3", tmp_path / "checkpoint-4")  # step 4 trained again
    report = json.loads((tmp_path / "nan_batches" / "step-3.json").read_text())
    assert report["update_skipped"] and [r["source_line"] for r in report["rows"]] == [5]
    assert report["rows"][0]["loss"] == "nan" and report["train_file"].endswith("train.jsonl")
    line5 = json.loads(sample_data.TRAIN_FILE.read_text().splitlines()[4])
    assert line5["messages"][-1]["content"] in report["rows"][0]["text"]
    assert "train.jsonl:5 (loss nan)" in proc.stdout + proc.stderr
    logs = {e["step"]: e for e in log_history(tmp_path, 5) if "loss" in e}
    assert logs[4]["learning_rate"] == logs[3]["learning_rate"]  # the schedule did not advance on step 3
    assert logs[3]["learning_rate"] != logs[2]["learning_rate"]
    assert logs[5]["guard/skipped_steps"] == 1


@pytest.mark.slow
def test_three_bad_steps_in_a_row_stop_with_a_checkpoint_that_resumes(tmp_path):
    proc = patched(POISON, {"POISON_LINES": "5,8,9"}, *ORDERED, "trainer.max_steps=8", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "3 bad steps in a row" in proc.stderr and "resume=auto" in proc.stderr
    assert (tmp_path / "checkpoint-5" / "sft_state.json").exists()
    assert same_params(tmp_path / "checkpoint-2", tmp_path / "checkpoint-5")
    assert sorted(p.name for p in (tmp_path / "nan_batches").iterdir()) == ["step-3.json", "step-4.json",
                                                                            "step-5.json"]
    resumed = run_train(*ORDERED, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "results.json").read_text())["global_step"] == 8


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_both(tmp_path):
    script = tmp_path / "poisoned_train.py"
    script.write_text("import os, sys\n" + POISON + "from sft.commands.train import cli\ncli()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(script), *ORDERED, "trainer.per_device_train_batch_size=1", "trainer.max_steps=4",
           f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "POISON_LINES": "6"})  # step 3: rank 0 has line 5, rank 1 line 6
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    assert same_params(run / "checkpoint-2", run / "checkpoint-3")
    report = json.loads((run / "nan_batches" / "step-3.json").read_text())
    assert [r["source_line"] for r in report["rows"]] == [6]  # gathered from rank 1 to rank 0's report


@pytest.mark.slow
def test_a_loss_spike_is_reported_and_with_skip_spikes_skipped(tmp_path):
    proc = patched(POISON, {"POISON_LINES": "11,12", "POISON_SCALE": "200"}, *ORDERED, "trainer.max_steps=7", "controllers.guard.spike_factor=3", "controllers.guard.spike_warmup=3",
                   "controllers.guard.skip_spikes=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "spikes" / "step-6.json").read_text())
    assert report["verdict"] == "spike" and report["update_skipped"] and len(report["rows"]) == 2
    assert same_params(tmp_path / "checkpoint-5", tmp_path / "checkpoint-6")
    assert not (tmp_path / "spikes" / "step-5.json").exists()


STALL_RANK_1 = """
import os, time
from sft.training.trainer import WeightedLossTrainer
_compute = WeightedLossTrainer.compute_loss
def compute_loss(self, model, inputs, *args, **kwargs):
    if model.training and self.state.global_step == 2 and os.environ["RANK"] == "1":
        time.sleep(600)  # a stuck rank
    return _compute(self, model, inputs, *args, **kwargs)
WeightedLossTrainer.compute_loss = compute_loss
"""


@pytest.mark.slow
def test_a_stalled_rank_makes_both_exit_with_its_stack_dumped(tmp_path):
    script = tmp_path / "stalled_train.py"
    script.write_text("import sys\n" + STALL_RANK_1 + "from sft.commands.train import cli\ncli()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(script), "trainer.max_steps=6", "trainer.eval_steps=100", "trainer.save_steps=100",
           "controllers.watchdog.timeout_s=10", f"data.eval_file={SMALL_EVAL}", f"hydra.run.dir={tmp_path / 'run'}"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert time.monotonic() - started < 150
    dump = (tmp_path / "run" / "hangs" / "rank-1.txt").read_text()
    assert dump.startswith("rank 1: watching for a hang after step 2 (armed ")
    assert "Where the stacks of every thread follow, no optimizer step completed within 10 s after step 2" in dump
    assert "compute_loss" in dump and "stalled_train.py" in dump  # the stack shows where it is stuck


OOM = """
import torch
from sft.training.trainer import WeightedLossTrainer
def compute_loss(self, *args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
WeightedLossTrainer.compute_loss = compute_loss
"""


@pytest.mark.slow
def test_out_of_memory_names_the_settings_and_the_knobs(tmp_path):
    """An out-of-memory error at every size: the step is tried in 2, 4, 8 and 16 pieces (each said), then the run
    stops saying why no smaller one is tried, the settings in use and the knobs that lower memory."""
    proc = patched(OOM, {}, "trainer.max_steps=2", "data.eval_file=null", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert [n for n in (2, 4, 8, 16) if f"with each micro-batch in {n} pieces (the step's rows" in proc.stdout] == \
        [2, 4, 8, 16]
    assert "CUDA out of memory with trainer.per_device_train_batch_size=16, data.max_length=256" in proc.stderr
    assert "(not retried at a smaller micro-batch: each piece of the micro-batch (16 sample(s) in 16 piece(s)) holds " \
           "one sample)" in proc.stderr
    assert "1) a smaller trainer.memory_limit_gib" in proc.stderr and "zero3_offload" in proc.stderr
    assert "a smaller trainer.per_device_train_batch_size with a larger trainer.gradient_accumulation_steps" in proc.stderr


GOOD = json.dumps(chat("What is 1 + 1?", "1 + 1 = 2", 1.0))


CORPUS = {
    "invalid_json": ([GOOD, '{"messages": [}'], 2, "row: invalid JSON"),
    "not_object": ([GOOD, GOOD, "42"], 3, "row: must be a JSON object"),
    "no_messages": (['{"difficulty_score": 1}'], 1, "row: no column of a known format: expected one of messages "
                                                    "(messages), conversations (sharegpt)"),
    "messages_not_list": (['{"messages": "hi", "difficulty_score": 1}'], 1, "messages: must be a non-empty list"),
    "no_role": (['{"messages": [{"content": "q"}], "difficulty_score": 1}'], 1, "messages[0].role: missing"),
    "no_content": (['{"messages": [{"role": "user"}], "difficulty_score": 1}'], 1, "messages[0].content: missing"),
    "unknown_role": (['{"messages": [{"role": "robot", "content": "q"}], "difficulty_score": 1}'], 1,
                     "messages[0].role: unknown role 'robot'"),
    "content_not_string": (['{"messages": [{"role": "user", "content": ["q"]}], "difficulty_score": 1}'], 1,
                           "messages[0].content[0]: must be a content part {type, text}, got str"),
    "empty_answer": (['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}], '
                      '"difficulty_score": 1}'], 1, "messages[1].content: empty assistant content"),
    "no_assistant": (['{"messages": [{"role": "user", "content": "q"}], "difficulty_score": 1}'], 1,
                     "messages: no assistant turn"),
    "score_string": ([GOOD.replace('"difficulty_score": 1.0', '"difficulty_score": "2"')], 1,
                     "difficulty_score: must be a finite number >= 0, got '2'"),
    "score_nan": ([GOOD.replace('"difficulty_score": 1.0', '"difficulty_score": NaN')], 1,
                  "difficulty_score: must be a finite number >= 0, got nan"),
    "score_inf": ([GOOD.replace('"difficulty_score": 1.0', '"difficulty_score": Infinity')], 1,
                  "difficulty_score: must be a finite number >= 0, got inf"),
    "score_negative": ([GOOD.replace('"difficulty_score": 1.0', '"difficulty_score": -0.5')], 1,
                       "difficulty_score: must be a finite number >= 0, got -0.5"),
    "score_missing": ([GOOD.replace(', "difficulty_score": 1.0', '')], 1, "difficulty_score: missing"),
    "score_too_large": ([GOOD.replace('"difficulty_score": 1.0', '"difficulty_score": 1' + '0' * 400)], 1,
                        "difficulty_score: must be a finite number >= 0, got an integer too large for a float "
                        "(401 digits)"),
    "lone_surrogate": ([GOOD.replace('"What is 1 + 1?"', '"What \\ud800 is"')], 1,
                       "messages[0].content: not valid Unicode (a lone surrogate at character 5)"),
    "nested_too_deep": (['[' * 100000 + ']' * 100000], 1, "row: nested too deeply"),
    "tool_calls": ([GOOD.replace('"1 + 1 = 2"}', '"1 + 1 = 2", "tool_calls": [{"name": "f"}]}')], 1,
                   "messages[1].tool_calls[0].function: missing (a call is {type: function, function: {name, "
                   "arguments}})"),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_malformed_file_is_rejected_with_line_and_reason(tmp_path, name):
    from sft.data.rows.reading import DataError, read_jsonl

    lines, line, message = CORPUS[name]
    f = write_jsonl(tmp_path / f"{name}.jsonl", lines)
    with pytest.raises(DataError) as e:
        read_jsonl(f)
    assert f"{f}:{line}: {message}" in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("content, message", [
    (b"", "file: no rows (the file is empty)"),
    (GOOD.encode() + b"\n" + b'{"messages": "\xff\xfe"}\n', ":2: row: not UTF-8"),
])
def test_empty_and_non_utf8_files_are_rejected_by_the_cli_without_traceback(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    proc = run_train("data=jsonl", f"data.train_file={f}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_a_missing_file_is_a_config_error():
    proc = run_train("data=jsonl", "data.train_file=/no/such/train.jsonl")
    assert proc.returncode == 2 and "data.train_file='/no/such/train.jsonl': no such file" in proc.stderr


@pytest.mark.slow
def test_on_error_skip_trains_on_valid_rows_counts_and_writes_rejected(tmp_path):
    rows = sample_data.TRAIN_FILE.read_text().splitlines()[:60]
    rows[9] = '{"messages": [}'
    rows[19] = rows[19].replace('"difficulty_score": ', '"difficulty_score": -')
    rows[29] = '{"messages": [{"role": "user", "content": "q"}], "difficulty_score": 1}'
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(rows).encode() + b"\r\n")  # BOM, CRLF, blank lines
    run = tmp_path / "run"
    proc = run_train("data=jsonl", f"data.train_file={f}", "data.on_error=skip", "trainer.max_steps=3",
                     "trainer.per_device_train_batch_size=8", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rejected = [json.loads(line) for line in (run / "rejected.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"]) for r in rejected] == [(19, "row"), (39, "difficulty_score"), (59, "messages")]
    assert "skipped 3 invalid row(s)" in proc.stdout + proc.stderr
    assert "difficulty_score: must be a finite number >= 0 x1" in proc.stdout + proc.stderr
    assert json.loads((run / "results.json").read_text())["global_step"] == 3


@pytest.mark.slow
def test_rows_without_a_score_train_where_no_part_of_the_run_uses_scores(tmp_path):
    def strip_scores(lines):  # every other row loses its difficulty_score
        return [json.dumps({k: v for k, v in json.loads(line).items() if k != "difficulty_score" or i % 2})
                for i, line in enumerate(lines)]

    train = write_jsonl(tmp_path / "train.jsonl", strip_scores(sample_data.TRAIN_FILE.read_text().splitlines()[:64]))
    evals = write_jsonl(tmp_path / "eval.jsonl", strip_scores(SMALL_EVAL.read_text().splitlines()))
    common = ["data=jsonl", f"data.train_file={train}", f"data.eval_file={evals}", "loss=ce", "trainer.max_steps=1",
              "trainer.eval_steps=100", "trainer.save_steps=100"]
    run = tmp_path / "run"
    proc = run_train(*common, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "eval_rows.jsonl").read_text().splitlines()]
    assert {r["difficulty_score"] is None for r in rows} == {True, False}  # no score: in no bucket
    results = json.loads((run / "results.json").read_text())
    for k, (low, high) in enumerate([(0, 1), (1, 2), (2, 3), (3, float("inf"))]):  # eval_buckets 1, 2, 3
        scored = [r for r in rows if r["difficulty_score"] is not None and low <= r["difficulty_score"] < high]
        expected = sum(r["ce_sum"] for r in scored) / sum(r["tokens"] for r in scored)
        assert results[f"eval_loss_bucket_{k}"] == pytest.approx(expected, rel=1e-9)  # the scored rows only
    ordered = run_train(*common, "+controllers=curriculum", f"hydra.run.dir={tmp_path / 'curriculum'}")
    assert ordered.returncode == 2 and "Traceback" not in ordered.stderr
    assert f"{train}:1: difficulty_score: missing (used by controllers.curriculum: set data.default_score" in \
        ordered.stderr and "or drop it: ~controllers.curriculum)" in ordered.stderr
