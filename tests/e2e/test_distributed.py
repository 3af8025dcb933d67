"""Real multi-process runs on CPU (gloo): DDP, DeepSpeed ZeRO-3 and FSDP2 through ./launch.sh, LoRA, one run dir."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL_EVAL, free_port, launch, moved_tiny_dir, run_train, step_losses
from omegaconf import OmegaConf
from safetensors.torch import load_file

# SGD (Adam would hide a wrong gradient scale), rows in file order, two logged and checkpointed steps.
EXACT = ["trainer.optim=sgd", "trainer.learning_rate=0.5", "trainer.lr_scheduler_type=constant",
         "trainer.warmup_steps=0", "clip=none", "trainer.train_sampling_strategy=sequential",
         "trainer.max_steps=2", "trainer.logging_steps=1", "trainer.save_steps=2", "trainer.eval_steps=100",
         "trainer.report_to=[]", f"data.eval_file={SMALL_EVAL}"]


def assert_same_run(one, two):
    assert step_losses(two, 2) == pytest.approx(step_losses(one, 2), abs=1e-5)
    a, b = load_file(one / "model" / "model.safetensors"), load_file(two / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (one, two))
    # The eval set (97 rows) does not split evenly into 2 ranks x 32: each row still counts once.
    assert rb["eval_loss"] == pytest.approx(ra["eval_loss"], abs=1e-5)
    assert rb["eval_loss_initial"] == pytest.approx(ra["eval_loss_initial"], abs=1e-5)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference for DDP and ZeRO-3: one plain process, batch 4, with static token weights (keywords: the
    sums after "=" weigh 3x) and per-turn weights on top of the difficulty weights."""
    run = tmp_path_factory.mktemp("one") / "run"
    single = run_train(*EXACT, *WEIGHTED, "trainer.per_device_train_batch_size=4", f"hydra.run.dir={run}")
    assert single.returncode == 0, single.stderr[-3000:]
    return run


def _turn_weighted_train_file():
    """Two-turn chats from the bundled rows, each turn with a weight of its own (0.5, 2, or untrained; then 1
    or 3): per-turn weights on top of the difficulty and keyword weights."""
    path = Path(tempfile.mkdtemp(prefix="sft-test-turns-")) / "train_turns.jsonl"
    rows = [json.loads(line) for line in (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()[:64]]
    with path.open("w") as f:
        for k, (a, b) in enumerate(zip(rows[::2], rows[1::2])):
            first, second = dict(a["messages"][-1]), dict(b["messages"][-1])
            first.update([{"weight": 0.5}, {"weight": 2.0}, {"train": False}][k % 3])
            second["weight"] = [1.0, 3.0][k % 2]
            chat = [*a["messages"][:-1], first, *[m for m in b["messages"][:-1] if m["role"] != "system"], second]
            f.write(json.dumps({"messages": chat, "difficulty_score": a["difficulty_score"]}) + "\n")
    return path


# Difficulty weights, keyword token weights and per-turn weights, all at once.
WEIGHTED = ["loss=keywords", "loss.alpha=1", f"data.train_file={_turn_weighted_train_file()}"]


# A controller of the user's kind (sft.training.controllers.base.Controller) that sends its own process a signal when
# a step begins: on every rank, as SLURM signals every process of a job step. SIGTERM lets the run save and
# stop; SIGKILL ends it with no handler and no checkpoint, as a lost node would.
SIGNAL_AT = """
import os, signal
from sft.training.controllers.base import Controller

class {cls}(Controller):
    name = "{name}"

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.{signal})
"""


SIGTERM_AT = SIGNAL_AT.format(cls="SigtermAt", name="sigterm_at", signal="SIGTERM")


SIGKILL_AT = SIGNAL_AT.format(cls="SigkillAt", name="sigkill_at", signal="SIGKILL")


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path, one_process):
    """With a memory limit nothing fits in (1 MiB): every rank takes rank 0's memory plan, one row a micro-batch
    with activation checkpointing (sft.run.memory_plan), and the run is still the one process's."""
    two = tmp_path / "two"
    double = launch("--nproc", "2", *EXACT, *WEIGHTED, "trainer.per_device_train_batch_size=2",
                    "trainer.memory_limit_gib=0.001", f"hydra.run.dir={two}")
    assert double.returncode == 0, double.stderr[-3000:]
    assert_same_run(one_process, two)
    log = (two / "train.log").read_text()
    assert "(activation checkpointing on; off, about " in log
    assert "; 1 row a micro-batch x 2 accumulated: the step's 2 rows (set: 2 x 1)" in log
    assert "memory: no micro-batch of the step's 2 rows fits the limit: set a smaller data.max_length" in log
    cores = len(os.sched_getaffinity(0))  # torchrun set OMP_NUM_THREADS=1; each process gets half the cores
    assert f"cpu: {max(1, cores // 2)} torch thread(s) per process, 2 process(es) on {cores} core(s)" in \
        (two / "train.log").read_text()
    # a dense model: DDP does not look for unused parameters, and no rank warns that it found none
    assert "find_unused_parameters" not in double.stderr + double.stdout


@pytest.mark.slow
def test_a_distillation_on_two_processes_equals_one_process(tmp_path):
    """The teacher is the tiny model, the student starts as it: from the second step on the student has moved and the
    divergence (here the skewed Jensen-Shannon, mostly) drives the update, normalised over both ranks' tokens. The same
    on two processes from a cache of every teacher logit (`sft distill cache`), which each rank attaches to its rows,
    under DDP and ZeRO-3."""
    from conftest import sft

    from sft.model.loading import load_model

    distill = [*EXACT, *WEIGHTED[1:], "loss=distill", "loss.divergence=jsd", "loss.kd_ratio=0.9"]
    one, two, cached = tmp_path / "one", tmp_path / "two", tmp_path / "cached"
    single = run_train(*distill, "+teacher=tiny", "trainer.per_device_train_batch_size=4", f"hydra.run.dir={one}")
    assert single.returncode == 0, single.stderr[-3000:]
    double = launch("--nproc", "2", *distill, "+teacher=tiny", "trainer.per_device_train_batch_size=2",
                    f"hydra.run.dir={two}")
    assert double.returncode == 0, double.stderr[-3000:]
    assert_same_run(one, two)
    assert "teacher: tiny (Qwen2ForCausalLM, " in (two / "train.log").read_text()
    vocab = load_model("tiny").config.vocab_size
    from_cache = [*distill, f"loss.teacher_cache={tmp_path / 'cache'}", f"loss.top_k={vocab}"]
    written = sft("distill", "cache", *from_cache, "+teacher=tiny")
    assert written.returncode == 0, written.stderr[-3000:]
    double = launch("--nproc", "2", *from_cache, "trainer.per_device_train_batch_size=2", f"hydra.run.dir={cached}")
    assert double.returncode == 0, double.stderr[-3000:]
    assert_same_run(one, cached)
    assert f"teacher: its top {vocab} logits a token from the cache" in (cached / "train.log").read_text()
    # ZeRO-3, which refuses a live teacher (it would shard it), trains from the cache: no teacher is loaded
    sharded = launch("--nproc", "2", *from_cache, "deepspeed=zero3", "trainer.per_device_train_batch_size=2",
                     f"hydra.run.dir={tmp_path / 'zero3'}")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert_same_run(one, tmp_path / "zero3")


@pytest.mark.slow
def test_reference_weights_on_two_processes_equal_one_process(tmp_path):
    """The main process scores the tokens (the model as it starts against a reference of its own), the other reads its
    scores from the cache: both ranks train on the one process's weights."""
    reference = moved_tiny_dir(tmp_path / "reference")
    weighed = [*EXACT, *WEIGHTED[1:], "loss=reference_weighted", "loss.top_ratio=0.5", "+reference=path",
               f"reference.name_or_path={reference}"]
    one, two = tmp_path / "one", tmp_path / "two"
    double = launch("--nproc", "2", *weighed, "trainer.per_device_train_batch_size=2", f"hydra.run.dir={two}")
    assert double.returncode == 0, double.stderr[-3000:]
    single = run_train(*weighed, "trainer.per_device_train_batch_size=4", f"hydra.run.dir={one}")
    assert single.returncode == 0, single.stderr[-3000:]
    assert_same_run(one, two)
    assert "loss: scoring " in (two / "train.log").read_text()  # scored by the two-process run, once
    assert "from the cache" in (one / "train.log").read_text()


@pytest.mark.slow
def test_sequence_parallel_under_zero3_preempted_then_resumed_equals_one_process(tmp_path, one_process):
    """Each sequence split over 2 ranks (`sp=ulysses`: DeepSpeed's Ulysses attention) under ZeRO-3, the group training
    the single process's 4-row micro-batches. SIGTERM on both ranks in step 1: each finishes the step, they save a
    complete checkpoint together and exit 75; `resume=auto` finishes the run: the losses, eval loss and weights are
    the single process's (padded rows, difficulty, keyword and per-turn weights), and generation samples run at
    evaluation, unsplit."""
    (tmp_path / "my_plugins.py").write_text(SIGTERM_AT)
    two = tmp_path / "two"
    args = ["--nproc", "2", "sp=ulysses", *EXACT, *WEIGHTED, "deepspeed=zero3", "trainer.per_device_train_batch_size=4",
            "eval_generation=default", f"hydra.run.dir={two}"]
    preempted = launch(*args, "+controllers.sigterm={_target_:my_plugins.SigtermAt,step:1}",
                       env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert preempted.returncode != 0 and preempted.stderr.count("preempted: SIGTERM at step 1") == 2, \
        preempted.stderr[-3000:]
    results = json.loads((two / "results.json").read_text())
    assert results["status"] == "preempted" and results["checkpoint"] == str(two / "checkpoint-1")
    assert (two / "checkpoint-1" / "sft_state.json").exists() and not (two / "checkpoint-2").exists()
    resumed = launch(*args, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((two / "results.json").read_text())["resumed_from"] == str(two / "checkpoint-1")
    assert "Ulysses attention over 2 ranks, micro-batches of 4 row(s), each rank 2 of 4 heads" in \
        (two / "train.log").read_text()
    assert "eval_gen/exact_match" in json.loads((two / "results.json").read_text())
    assert_same_run(one_process, two)


@pytest.mark.slow
def test_sequence_parallel_packed_equals_one_packed_process(tmp_path):
    """Packed rows split over 2 ranks under DDP (each packed row padded to an even length; the samples told apart by
    the gathered positions): the single packed process's step losses, eval loss and weights."""
    packed = [*EXACT, *WEIGHTED, "data.packing=true", "trainer.per_device_train_batch_size=4"]
    one = tmp_path / "one"
    single = run_train(*packed, f"hydra.run.dir={one}")
    assert single.returncode == 0, single.stderr[-3000:]
    two = tmp_path / "two"
    split = launch("--nproc", "2", "sp=ulysses", *packed, f"hydra.run.dir={two}")
    assert split.returncode == 0, split.stderr[-3000:]
    assert "micro-batches of 1 row(s)" in (two / "train.log").read_text()
    assert_same_run(one, two)


@pytest.mark.slow
def test_zero2_with_tiled_mlps_equals_one_process_without(tmp_path, one_process):
    """Two processes under ZeRO-2 with every MLP in tiles (`model.tiled_mlp_tokens`): each weight's gradient reduced
    once, after its last tile, over the ranks: the untiled single process's losses, eval loss and weights."""
    two = tmp_path / "two"
    tiled = launch("--nproc", "2", *EXACT, *WEIGHTED, "deepspeed=zero2", "model.tiled_mlp_tokens=24",
                   "trainer.per_device_train_batch_size=2", f"hydra.run.dir={two}")
    assert tiled.returncode == 0, tiled.stderr[-3000:]
    assert "4 MLPs tiled" in (two / "train.log").read_text()
    assert_same_run(one_process, two)


def eval_loss_in_a_plain_process(adapter_dir):
    """Eval loss of base + saved adapter in a fresh process, with plain PEFT and no DeepSpeed or FSDP."""
    script = f"""
import json, sys
from peft import PeftModel
from transformers import TrainingArguments
from sft.data.tokens.collator import WeightedDataCollator
from sft.data.load import load_sft_datasets
from sft.data.spec import DataSpec
from sft.loss.builtin import HardSampleLoss
from sft.model.loading import load_model, load_tokenizer
from sft import sample_data
from sft.training.trainer import WeightedLossTrainer
tok = load_tokenizer("tiny")
loss = HardSampleLoss(impl="naive")  # the run's own evaluation took the chunked path, sharded
spec = DataSpec(train_file=str(sample_data.TRAIN_FILE), eval_file={str(SMALL_EVAL)!r}, max_length=256)
data = load_sft_datasets(spec, tok, loss)
model = PeftModel.from_pretrained(load_model("tiny"), {str(adapter_dir)!r})
args = TrainingArguments(output_dir={str(adapter_dir / "eval")!r}, per_device_eval_batch_size=32, report_to=[],
                         remove_unused_columns=False, use_cpu=True)
trainer = WeightedLossTrainer(model=model, args=args, eval_dataset=data.eval, loss=loss,
                              data_collator=WeightedDataCollator(tok), processing_class=tok)
print(json.dumps(trainer.evaluate()))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]


@pytest.mark.slow
def test_zero3_lora_two_processes_save_a_full_adapter_that_reloads_and_resumes(tmp_path):
    """ZeRO-3 from a DeepSpeed JSON file of the user's (`deepspeed=file`): the zero3 preset, written as JSON."""
    run = tmp_path / "run"
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(json.dumps(OmegaConf.to_container(OmegaConf.load(REPO / "sft/conf/deepspeed/zero3.yaml")), indent=2))
    common = ["deepspeed=file", f"deepspeed.path={ds_json}", "lora=default", "trainer.learning_rate=1e-2", "trainer.save_steps=4",
              f"data.eval_file={SMALL_EVAL}",
              "trainer.eval_steps=100", "trainer.logging_steps=1", f"hydra.run.dir={run}"]
    first = launch("--nproc", "2", *common, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert_whole_adapter(run / "model" / "adapter_model.safetensors")
    results = json.loads((run / "results.json").read_text())
    assert results["loss_impl"] == "chunked"  # LoRA leaves the lm_head frozen: gathered for the loss, not updated
    assert eval_loss_in_a_plain_process(run / "model") == pytest.approx(results["eval_loss"], abs=1e-4)

    second = launch("--nproc", "2", *common, "trainer.max_steps=6", "resume=auto")
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = json.loads((run / "results.json").read_text())
    assert resumed["resumed_from"] == str(run / "checkpoint-4") and resumed["global_step"] == 6


def harness_in_a_plain_process(adapter_dir) -> float:
    """The bundled perplexity task on the saved adapter over the tiny base, in this process."""
    from peft import PeftModel

    from sft.eval.harness import EvalHarness
    from sft.model.loading import load_model, load_tokenizer

    model = PeftModel.from_pretrained(load_model("tiny"), str(adapter_dir)).eval()
    harness = EvalHarness(tasks=["sft_sample_addition_ppl"], limit=8, system_instruction="You add numbers.")
    return harness.run(model, load_tokenizer("tiny"))["eval_harness/sft_sample_addition_ppl/byte_perplexity"]


def assert_whole_adapter(adapter_file):
    """Every projection's LoRA pair at its full shape (never one rank's shard), lora_B trained."""
    adapter = load_file(adapter_file)
    lora_a = [k for k in adapter if "lora_A" in k]
    lora_b = [k for k in adapter if "lora_B" in k]
    assert len(lora_a) == len(lora_b) == 4 * 7  # every projection of the tiny model's 4 layers
    assert adapter["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (16, 384)
    assert adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (64, 16)
    assert any(adapter[k].abs().sum() > 0 for k in lora_b), "lora_B stayed zero: no training reached the adapter"
    return adapter


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_preempted_then_resumed_equals_one_process(tmp_path):
    """FSDP2 (full fine-tuning: the tied lm_head sharded and trained, the lean loss on its gathered weight) with
    FSDP's activation checkpointing, two processes, SIGTERM in step 1, `resume=auto`: the same step losses,
    weights and eval losses as one plain process. Plain SGD: an optimizer state without a tensor, which torch's
    `set_optimizer_state_dict` would refuse; the schedule alone is reloaded (AdamW's state under FSDP: the LoRA test
    below), with a warm-up so that the learning rate the optimizer resumes at is the schedule's."""
    exact = [*(o for o in EXACT if not o.startswith(("trainer.lr_scheduler_type=", "trainer.warmup_steps="))),
             "trainer.lr_scheduler_type=linear", "trainer.warmup_steps=1"]
    one = tmp_path / "one"
    single = run_train(*exact, *WEIGHTED, "trainer.per_device_train_batch_size=4", f"hydra.run.dir={one}")
    assert single.returncode == 0, single.stderr[-3000:]
    (tmp_path / "my_plugins.py").write_text(SIGTERM_AT)
    two = tmp_path / "two"
    args = ["--nproc", "2", *exact, *WEIGHTED, "fsdp=full_shard", "trainer.activation_checkpointing=true",
            "trainer.per_device_train_batch_size=2", f"hydra.run.dir={two}"]
    preempted = launch(*args, "+controllers.sigterm={_target_:my_plugins.SigtermAt,step:1}",
                       env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert preempted.returncode != 0, preempted.stderr[-3000:]
    assert preempted.stderr.count("preempted: SIGTERM at step 1") == 2  # both ranks
    assert (two / "checkpoint-1" / "sft_state.json").exists() and not (two / "checkpoint-2").exists()
    resumed = launch(*args, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    results = json.loads((two / "results.json").read_text())
    assert results["resumed_from"] == str(two / "checkpoint-1") and results["loss_impl"] == "chunked"
    assert_same_run(one, two)


@pytest.mark.slow
def test_fsdp_lora_saves_a_whole_adapter_that_reloads_and_resumes_exactly_after_a_kill(tmp_path):
    """FSDP2 with LoRA (AdamW: optimizer state to restore) and generation samples, two processes. The adapter is whole
    and gives the run's eval loss under plain PEFT; a run killed in step 3 resumes from checkpoint-2 and logs
    the same losses and saves the same adapter as the uninterrupted run."""
    (tmp_path / "my_plugins.py").write_text(SIGKILL_AT)
    common = ["--nproc", "2", "fsdp=full_shard", "lora=default", "trainer.learning_rate=1e-2",
              "trainer.max_steps=4", "trainer.save_steps=2", "trainer.logging_steps=1", "trainer.eval_steps=100",
              "trainer.train_sampling_strategy=sequential", "trainer.report_to=[]", f"data.eval_file={SMALL_EVAL}",
              "eval_generation=default"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # with the benchmark after training: the ranks hold shards, so rank 0 evaluates the saved adapter
    first = launch(*common, "eval_harness=sample", "eval_harness.tasks=[sft_sample_addition_ppl]",
                   "eval_harness.limit=8", f"hydra.run.dir={whole}")
    assert first.returncode == 0, first.stderr[-3000:]
    adapter = assert_whole_adapter(whole / "model" / "adapter_model.safetensors")
    results = json.loads((whole / "results.json").read_text())
    assert results["eval_harness/sft_sample_addition_ppl/byte_perplexity"] == pytest.approx(
        harness_in_a_plain_process(whole / "model"), rel=1e-5)
    assert results["loss_impl"] == "chunked"  # the frozen lm_head gathered for the lean loss
    history = json.loads((whole / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    # synced generation on both ranks, at the first evaluation and the last step's
    assert [e["step"] for e in history if "eval_gen/exact_match" in e] == [0, 4]
    assert eval_loss_in_a_plain_process(whole / "model") == pytest.approx(results["eval_loss"], abs=1e-4)

    env = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    lost = launch(*common, f"hydra.run.dir={killed}", "+controllers.kill={_target_:my_plugins.SigkillAt,step:3}",
                  env=env)
    assert lost.returncode != 0 and not (killed / "results.json").exists()
    assert (killed / "checkpoint-2" / "sft_state.json").exists() and not (killed / "checkpoint-4").exists()
    resumed = launch(*common, f"hydra.run.dir={killed}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((killed / "results.json").read_text())["resumed_from"] == str(killed / "checkpoint-2")
    assert step_losses(killed, 4) == pytest.approx(step_losses(whole, 4), abs=1e-5)
    again = load_file(killed / "model" / "adapter_model.safetensors")
    for key in adapter:
        torch.testing.assert_close(again[key], adapter[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.slow
def test_two_nodes_over_loopback_share_one_run_dir(tmp_path):
    run = tmp_path / "run"
    port = str(free_port())
    cmd = [str(REPO / "launch.sh"), "--nproc", "1", "trainer.max_steps=2", "trainer.eval_steps=100",
           "trainer.save_steps=2", f"hydra.run.dir={run}"]
    env = {**__import__("os").environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    nodes = [subprocess.Popen(cmd, cwd=REPO, env={**env, "NODE_RANK": str(k)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outputs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    results = json.loads((run / "results.json").read_text())
    assert results["global_step"] == 2
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["train_batch_size"] == 16  # per device; the two nodes train together:
    assert state["log_history"][-1]["num_input_tokens_seen"] > 2 * 16 * 20  # 2 steps x 2 ranks x 16 rows


@pytest.mark.slow
def test_torchrun_with_the_default_dir_makes_one_run_dir(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "sft.train", "trainer.max_steps=1", "trainer.eval_steps=100",
           "trainer.save_steps=100", "trainer.report_to=[tensorboard]"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1, runs
    run = runs[0]
    assert (run / "results.json").exists() and (run / "train.log").exists()
    events = list(run.glob("runs/*/events.out.tfevents.*"))  # name: ...tfevents.<time>.<host>.<pid>.<n>
    assert events and len({e.name.split(".")[-2] for e in events}) == 1  # TensorBoard from rank 0 only
    assert (run / ".hydra" / "config.yaml").exists() and proc.stdout.count("run dir:") == 1


@pytest.mark.slow
def test_deepspeed_presets_are_accepted_by_training_arguments(tmp_path):
    script = """
from sft.config import check, compose
from sft.run.build import arguments
import json, sys
from omegaconf import OmegaConf
final = {}
for preset in ("zero2", "zero3", "zero3_offload", "file"):
    extra = [f"deepspeed.path={sys.argv[1]}"] if preset == "file" else []
    cfg = compose("train", [f"deepspeed={preset}", *extra])
    check(cfg)
    args = arguments(cfg, "/tmp/unused", resuming=False, max_grad_norm=1.0)
    final[preset] = args.hf_deepspeed_config.config
    stage = final[preset]["zero_optimization"]["stage"]
    print(preset, stage, final[preset]["train_micro_batch_size_per_gpu"])
print("file equals zero3:", final["file"] == final["zero3"])
"""
    # A user's DeepSpeed JSON with the zero3 preset's content, "auto" values included, becomes the same config.
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps(OmegaConf.to_container(OmegaConf.load(REPO / "sft/conf/deepspeed/zero3.yaml"))))
    proc = subprocess.run([sys.executable, "-c", script, str(ds_json)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-6:-1] == ["zero2 2 16", "zero3 3 16", "zero3_offload 3 16", "file 3 16",
                                              "file equals zero3: True"]


@pytest.mark.slow
def test_a_refusal_inside_the_ranks_is_one_line_under_launch_sweeps_and_two_nodes(tmp_path):
    """Bad data, found by every rank as it reads it (after launch.sh's check of the config): one `error:` line, exit 2,
    no launcher traceback: under `--nproc 2`, in a sweep's job, and on each node of a two-node launch."""
    bad = tmp_path / "bad.jsonl"
    rows = (REPO / "sft/sample_data/train.jsonl").read_text().splitlines()[:20]
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}\n'
                   + "\n".join(rows) + "\n")
    said = ["error: 1 bad row(s) in the data:", f"  {bad}:1: messages[1].content: must be a string, got int"]

    def one_line(stderr: str) -> bool:
        return (stderr.count("error:") == 1 and "\n".join(said) in stderr and "Traceback" not in stderr
                and "ChildFailedError" not in stderr)

    args = [f"data.train_file={bad}", "trainer.max_steps=1"]
    two = launch("--nproc", "2", *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert two.returncode == 2 and one_line(two.stderr), two.stderr[-3000:]

    sweep = launch("--nproc", "2", "-m", *args, "trainer.learning_rate=1e-3,2e-3", f"hydra.sweep.dir={tmp_path / 'sw'}")
    results = [json.loads((tmp_path / "sw" / str(k) / "results.json").read_text()) for k in (0, 1)]
    assert [r["status"] for r in results] == ["failed", "failed"], sweep.stderr[-3000:]
    assert all(r["error"] == f"exit code 2: 1 bad row(s) in the data: {said[1].strip()}" for r in results)
    assert sweep.stderr.count(said[1]) == 2 and "Traceback" not in sweep.stderr, sweep.stderr[-3000:]

    port = str(free_port())
    cmd = [str(REPO / "launch.sh"), "--nproc", "1", *args, f"hydra.run.dir={tmp_path / 'nodes'}"]
    env = {**os.environ, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    nodes = [subprocess.Popen(cmd, cwd=REPO, env={**env, "NODE_RANK": str(k)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outputs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [2, 2] and all(one_line(err) for _, err in outputs), outputs


# FSDP2 full fine-tuning with sharded checkpoints (the default there): six SGD steps with momentum (state to restore),
# a checkpoint every two.
SHARDED = [*EXACT, 'trainer.optim_args="momentum=0.5"', "fsdp=full_shard", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """The uninterrupted reference: two processes, batch 2 each."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    done = launch("--nproc", "2", *SHARDED, "trainer.per_device_train_batch_size=2", f"hydra.run.dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow
def test_sharded_checkpoints_hold_every_ranks_shards_and_consolidate_offline_into_the_served_model(sharded_run,
                                                                                                  tmp_path):
    """Each rank wrote its own DCP shards of the model and optimizer (nothing gathered), listed in the completion
    marker; `sft consolidate` turns the last one, in one process, into the model the run served (`model/`, itself
    consolidated from shards), which transformers loads with the tied output layer once."""
    from transformers import AutoModelForCausalLM

    checkpoint = sharded_run / "checkpoint-6"
    files = json.loads((checkpoint / "sft_state.json").read_text())["files"]
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{part}/.metadata", f"{part}/__0_0.distcp", f"{part}/__1_0.distcp"} <= files.keys()
    assert not (checkpoint / "model.safetensors").exists() and (checkpoint / "config.json").exists()
    log = (sharded_run / "train.log").read_text()
    assert "checkpoint-2 (sharded): " in log and "memory above the step's: rank 0 +" in log
    # the bench's checkpoint_memory case reads these lines and shards (sft.bench.checkpoint_memory)
    from sft.bench.checkpoint_memory import checkpoint_bytes, save_figures

    saved = save_figures(log)
    assert saved["seconds"] > 0 and len(saved["rank_mib"]) == 2
    whole = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    assert 0 < checkpoint_bytes(checkpoint) < whole  # the model's and optimizer's shards: not the config, tokenizer
    out = tmp_path / "consolidated"
    proc = subprocess.run([sys.executable, "-m", "sft", "consolidate", str(checkpoint), str(out), "--max-file-gb",
                           "0.0005"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    served = load_file(sharded_run / "model" / "model.safetensors")
    assert "lm_head.weight" not in served  # tied: written once, as save_pretrained does
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, tensor in served.items():
        torch.testing.assert_close(loaded[key], tensor, atol=0, rtol=0, msg=key)
    refused = subprocess.run([sys.executable, "-m", "sft", "consolidate", str(tmp_path), str(out)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith(f"error: {tmp_path}: no sharded model")


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_a_sharded_run_killed_resumes_on_another_number_of_processes_as_if_uninterrupted(sharded_run, tmp_path,
                                                                                        first, then):
    """Killed (SIGKILL) in step 3, resumed from checkpoint-2 with another number of processes: the shards reload onto
    the new ranks, the step keeps its 4 rows (batch and accumulation adjusted, said in the log), the data goes on at
    the next row; step losses and weights are the uninterrupted two-process run's."""
    (tmp_path / "my_plugins.py").write_text(SIGKILL_AT)
    run = tmp_path / "run"
    batch = {1: 4, 2: 2}[first]
    args = [*SHARDED, f"trainer.per_device_train_batch_size={batch}", f"hydra.run.dir={run}"]
    killed = launch("--nproc", str(first), *args, "+controllers.kill={_target_:my_plugins.SigkillAt,step:3}",
                    env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert killed.returncode != 0 and (run / "checkpoint-2" / "sft_state.json").exists()
    resumed = launch("--nproc", str(then), *args, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    kept = {(2, 1): "per-device batch 2 -> 2, gradient accumulation 1 -> 2",
            (1, 2): "per-device batch 4 -> 2, gradient accumulation 1 -> 1"}[(first, then)]
    assert f"was saved by {first} process(es), this run has {then}: {kept} (the step keeps its 4 rows)" in \
        (run / "train.log").read_text()
    # 1e-5, or 1e-6 of a loss: the loss grows to 12.7 by step 6, where fp32 sums in another order differ by 1e-5
    # (seen on an AMD EPYC, 2026-12-05, with the code before any change of that day)
    assert step_losses(run, 6) == pytest.approx(step_losses(sharded_run, 6), rel=1e-6, abs=1e-5)
    a, b = load_file(sharded_run / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)


# The writer of checkpoint-4's shards held up for a minute: the process is killed while they are being written.
SLOW_WRITES = """
import time
from torch.distributed.checkpoint.filesystem import FileSystemWriter

_write_data = FileSystemWriter.write_data

def write_data(self, plan, planner):
    if "checkpoint-4" in str(self.path):
        time.sleep(60)
    return _write_data(self, plan, planner)

FileSystemWriter.write_data = write_data
"""


@pytest.mark.slow
def test_async_checkpoints_are_complete_only_once_written_and_a_kill_meanwhile_leaves_the_previous_newest(
        sharded_run, tmp_path):
    """`checkpoint.async_save`: training goes on while the shards are written; checkpoint-2 becomes complete once
    both ranks' writes end, checkpoint-4 (its writes held up) is still incomplete when the run is killed in step 6.
    `resume=auto` takes checkpoint-2, removes checkpoint-4's debris, and ends as the uninterrupted run."""
    (tmp_path / "my_plugins.py").write_text(SLOW_WRITES + SIGKILL_AT)
    run = tmp_path / "run"
    args = [*SHARDED, "checkpoint.async_save=true", "trainer.per_device_train_batch_size=2", f"hydra.run.dir={run}"]
    killed = launch("--nproc", "2", *args, "+controllers.kill={_target_:my_plugins.SigkillAt,step:6}",
                    env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert killed.returncode != 0 and not (run / "results.json").exists()
    assert (run / "checkpoint-2" / "sft_state.json").exists()
    assert (run / "checkpoint-4").is_dir() and not (run / "checkpoint-4" / "sft_state.json").exists()
    assert "checkpoint-4 (sharded, in the background)" in (run / "train.log").read_text()
    resumed = launch("--nproc", "2", *args, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert "a checkpoint left incomplete by a crash" in log and "resuming from " + str(run / "checkpoint-2") in log
    assert (run / "checkpoint-6" / "sft_state.json").exists()
    # 1e-5, or 1e-6 of a loss: the loss grows to 12.7 by step 6, where fp32 sums in another order differ by 1e-5
    # (seen on an AMD EPYC, 2026-12-05, with the code before any change of that day)
    assert step_losses(run, 6) == pytest.approx(step_losses(sharded_run, 6), rel=1e-6, abs=1e-5)
    a, b = load_file(sharded_run / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)
