"""The bench's training and evaluation cases (`sft.bench.cases`), each run in a process of its own: this project's
trainer, a plain `Trainer`, TRL's `SFTTrainer` or a hand-written loop trains the same rows (`run_training_case`: tokens
per second, memory, MFU), or `Trainer.evaluate()` is timed (`run_eval_case`)."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import time

from omegaconf import OmegaConf

from sft.bench.device import on_gpu

# the trainer each case trains with that is not this project's (`case_trainer`)
HF_CASES = ("hf", "hf_padding_free", "eval_hf")  # a plain `Trainer`
TRL_CASES = ("trl", "trl_padding_free", "trl_padding_free_mask", "trl_best")  # TRL's `SFTTrainer`
FASTEST_CASES = ("trl_best", "hf_padding_free")  # each trainer with its own fastest documented settings
CACHE_IN_SCRATCH = "scratch"  # a case's loss.teacher_cache: written by the case (untimed) into its scratch dir


def scratch_dir(case: str) -> str:
    """The output dir of a case's Trainer (nothing is kept there), removed when the case's process exits."""
    path = tempfile.mkdtemp(prefix=f"sft-bench-{case}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def timed_training_overrides(cfg) -> list[str]:
    """Train `bench.steps` steps (and `bench.profile_steps` more, profiled after the timed ones), log once at the end;
    no evaluation, checkpoints or trackers."""
    steps = cfg.bench.steps + cfg.bench.profile_steps
    return [f"trainer.max_steps={steps}", "trainer.eval_strategy=no", "trainer.save_strategy=no",
            "trainer.report_to=[]", f"trainer.logging_steps={steps}", "trainer.logging_first_step=false",
            "trainer.disable_tqdm=true", "data.eval_file=null"]


def step_clock():
    """A Trainer callback that records the wall and CPU time at the end of every optimizer step (`.times`, `.cpu`)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.cpu: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.tick()

        def tick(self):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())

    return StepClock()


class CountingCollator:
    """Wraps a collator; records each batch's input tokens (padding excluded), in order."""

    def __init__(self, collator):
        self.collator, self.tokens = collator, []

    def __call__(self, features):
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        return self.collator(features)


def case_trainer(case: str, cfg, run_dir: str):
    """The trainer `case` trains (or evaluates) with: this project's (`sft.run.build`), a plain `Trainer`
    (`hf`, `hf_padding_free`), or TRL's `SFTTrainer` (`trl`, ...), the last two on `sft`'s own tokenised rows and
    labels, so every case sees the same tokens."""
    if case not in (*HF_CASES, *TRL_CASES):
        from sft.run.build import build

        if cfg.loss.get("teacher_cache") == CACHE_IN_SCRATCH:  # the teacher's logits written first, not timed
            from sft.run.teacher_cache import write_teacher_cache

            cfg = OmegaConf.merge(cfg, {"loss": {"teacher_cache": os.path.join(scratch_dir(f"{case}-cache"), "c")}})
            write_teacher_cache(cfg)
        return build(cfg, run_dir).trainer
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.data.load import load_sft_datasets
    from sft.loss.base import build_loss
    from sft.run.build import build_model
    from sft.training.arguments import TrainerConfig, learning_rate, resolve_nulls

    fields = OmegaConf.to_container(cfg.trainer, resolve=True)
    for name in TrainerConfig.sft_fields:  # sft's own knobs, not TrainingArguments fields
        fields.pop(name)
    fields.update(output_dir=run_dir, max_grad_norm=cfg.clip.get("max_norm", 0.0), learning_rate=learning_rate(cfg))
    fields["dataloader_pin_memory"] &= on_gpu()
    resolve_nulls(fields, on_gpu())  # the optimizer a null is; checkpointing off (no memory plan here)
    if case in FASTEST_CASES:
        settings = fastest_settings()
        fields["use_liger_kernel"] = settings["use_liger_kernel"]
        cfg = OmegaConf.merge(cfg, {"model": {"attn_implementation": settings["attn_implementation"]}})
    if case.startswith("trl"):
        from trl import SFTConfig

        # sft's rows are already cut to data.max_length; the rest of TRL's defaults as a user meets them.
        padding_free = case.startswith("trl_padding_free") or case == "trl_best"
        args = SFTConfig(**fields, max_length=None, padding_free=padding_free, dataset_num_proc=None)
    else:
        from transformers import TrainingArguments

        args = TrainingArguments(**fields)
    set_seed(args.seed)
    tokenizer = instantiate(cfg.tokenizer)
    data = load_sft_datasets(instantiate(cfg.data, _convert_="object"), tokenizer, build_loss(cfg.loss))
    model = build_model(cfg, args.activation_checkpointing)
    if case.startswith("trl"):
        from trl import SFTTrainer

        keep = ["input_ids", "labels"]  # with `labels` present, TRL trains on exactly these (no re-tokenising)
        return SFTTrainer(model=model, args=args, train_dataset=data.train.select_columns(keep),
                          eval_dataset=data.eval.select_columns(keep) if data.eval is not None else None,
                          processing_class=tokenizer)
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer

    # transformers' own padding-free batches (one row, position_ids restarting at each sample; the first label of
    # each sample dropped, which sft's prompt tokens already are), or rows padded to the longest
    collator = (DataCollatorWithFlattening() if case == "hf_padding_free"
                else DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100))
    return Trainer(model=model, args=args, train_dataset=data.train, eval_dataset=data.eval, data_collator=collator,
                   processing_class=tokenizer)


def fastest_settings() -> dict:
    """TRL's and a plain Trainer's fastest documented settings on this machine: Liger's kernels
    (`use_liger_kernel`: RMSNorm, RoPE, SwiGLU and the fused linear cross entropy) on a GPU with liger-kernel, and
    flash attention 2 where flash-attn is installed, else sdpa (on padding-free rows transformers then masks each
    sample from the others, read from the position ids). Activation checkpointing stays off (their fastest where
    the step fits, as sft's memory plan leaves it)."""
    from sft.bench.device import flash_missing, liger_missing

    return {"use_liger_kernel": liger_missing() is None,
            "attn_implementation": "sdpa" if flash_missing() else "flash_attention_2"}


def run_training_case(case: str, cfg) -> dict:
    """Train as `case` says; tokens per second over the timed steps, the CPU time they took and its share of the
    threads' wall time (below 1: other work took cores), peak memory, MFU where known."""
    import torch

    from sft.bench.profile import step_profiler
    from sft.data.tokens.columns import assistant_tokens, column
    from sft.training.observability.throughput import (device_peak_tflops, flops_per_token, model_flops_per_token,
                                                       peak_memory_gb, unknown_peak)

    trainer = case_trainer(case, cfg, scratch_dir(case))
    collator = trainer.data_collator = CountingCollator(trainer.data_collator)
    clock, steps = step_clock(), cfg.bench.steps
    profiler = step_profiler(steps, cfg.bench.profile_steps) if cfg.bench.profile_steps else None
    if case == "raw":
        losses = raw_loop(trainer, clock)
    else:
        trainer.add_callback(clock)
        if profiler is not None:  # after the timed steps: its own cost is not timed
            trainer.add_callback(profiler)
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]

    accumulation, warmup = trainer.args.gradient_accumulation_steps, cfg.bench.warmup_steps
    timed_batches = collator.tokens[warmup * accumulation: steps * accumulation]
    seconds = clock.times[steps - 1] - clock.times[warmup - 1]
    cpu_seconds = clock.cpu[steps - 1] - clock.cpu[warmup - 1]
    tokens_per_second = sum(timed_batches) / seconds
    result = {"tokens_per_second": tokens_per_second, "peak_memory_gb": peak_memory_gb(),
              "timed_steps": steps - warmup, "seconds": seconds, "cpu_seconds": cpu_seconds,
              "threads": torch.get_num_threads(), "losses": losses}
    if not on_gpu():  # the threads' CPU time over their wall time: 1 on a quiet machine
        result["cpu_share"] = cpu_seconds / (seconds * torch.get_num_threads())
    if profiler is not None and profiler.result is not None:
        result["breakdown"] = profiler.result
    lengths = [len(ids) for ids in column(trainer.train_dataset, "input_ids")]
    mean_length = sum(lengths) / len(lengths)
    # A lean loss kernel projects only the trained positions (their share of the input tokens); the model's own
    # logits, every position
    lean = getattr(trainer, "loss_impl", "naive") != "naive"
    computed = int(assistant_tokens(trainer.train_dataset).sum()) / sum(lengths) if lean else 1.0
    flops = flops_per_token(trainer.model, mean_length, computed) * tokens_per_second
    result["exec_gflops"] = flops / 1e9  # the FLOP/s of the products the step ran (matmul: their limit)
    result["model_gflops"] = model_flops_per_token(trainer.model, mean_length) * tokens_per_second / 1e9  # 6N: MFU's
    result["dtype"] = "bfloat16" if trainer.args.bf16 else str(cfg.model.dtype)  # the limit it is held to
    peak = cfg.throughput.peak_tflops or device_peak_tflops()
    if peak is None and on_gpu():
        print(unknown_peak(torch.cuda.get_device_name()), file=sys.stderr)
    if peak:  # executed FLOPs over the GPUs' peak; beside it the 6N convention's (`mfu_6n`)
        result["mfu"] = flops / (peak * 1e12 * trainer.args.world_size)
        result["mfu_6n"] = result["model_gflops"] * 1e9 / (peak * 1e12 * trainer.args.world_size)
    return result


def raw_loop(trainer, clock) -> list[float]:
    """A hand-written PyTorch loop over `trainer`'s own batches (sft's rows, order and collator): the model's
    logits, the cross entropy of the step's assistant tokens over their count, backward, clipping at
    `max_grad_norm`, AdamW and the same learning-rate schedule. What no framework can beat by much (`sft_vs_raw`);
    its step losses equal `ce_naive`'s (tested). Returns them."""
    import torch
    import torch.nn.functional as F
    from transformers import get_scheduler

    model, args = trainer.model, trainer.args
    steps, accumulation = args.max_steps, args.gradient_accumulation_steps
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(steps),
                              num_training_steps=steps)
    batches, losses = iter(()), []
    model.train()
    for _ in range(steps):
        micro = []
        for _ in range(accumulation):
            try:
                micro.append(next(batches))
            except StopIteration:  # the next epoch
                batches = iter(trainer.get_train_dataloader())
                micro.append(next(batches))
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        total = 0.0
        for b in micro:
            logits = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"),
                           position_ids=b.get("position_ids")).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), b["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum") / count
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        clock.tick()
    return losses


def run_eval_case(case: str, cfg) -> dict:
    """`trainer.evaluate()` on the eval rows, a plain Trainer's (`eval_hf`) or this project's (`eval_sft`):
    seconds per 1,000 rows, the best of `bench.eval_repeats` after one untimed evaluation."""
    trainer = case_trainer(case, cfg, scratch_dir(case))
    trainer.evaluate()  # warms up: first batches, lazy initialisation
    best = float("inf")
    for _ in range(cfg.bench.eval_repeats):
        started = time.perf_counter()
        trainer.evaluate()
        best = min(best, time.perf_counter() - started)
    rows = len(trainer.eval_dataset)
    return {"seconds_per_1000_rows": 1000 * best / rows, "rows": rows}


def show_eval(name: str, report: dict) -> list[str]:
    """An eval case's line in the printed report."""
    c = report["cases"][name]
    return [f"{name:<22}{c['seconds_per_1000_rows']:>10.2f} s per 1,000 eval rows ({c['rows']} rows)"]
