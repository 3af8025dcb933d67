"""The bench's `long_rows` case (on request): one packed row a step of each of `bench.long_row_lengths` tokens, plain,
checkpointed, with tiled MLPs, (GPU) offloaded checkpoints and each row split over 2 processes (`sp=ulysses`):
tokens/s and memory per token (docs/long_context.md)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from sft.bench.device import memory_peak, memory_reset, on_gpu
from sft.bench.rows import multi_turn_rows
from sft.bench.training import CountingCollator, scratch_dir, step_clock, timed_training_overrides

# The long_rows case's variants: what each adds to a packed run of one row per step (offloading on a GPU only;
# sequence parallelism in 2 processes, each holding half of the row: `LONG_ROW_PROCESSES`).
LONG_ROW_VARIANTS = {"plain": [], "checkpointed": ["trainer.activation_checkpointing=true"],
                     "tiled": ["trainer.activation_checkpointing=true", "model.tiled_mlp_tokens={tile}"],
                     "offloaded": ["trainer.activation_checkpointing=true", "model.tiled_mlp_tokens={tile}",
                                   "trainer.activation_offloading=true"],
                     "sequence_parallel": ["trainer.activation_checkpointing=true", "sp=ulysses", "sp.size=2"]}
LONG_ROW_PROCESSES = {"sequence_parallel": 2}


def run_long_rows_case(case: str, cfg) -> dict:
    """One packed row of `data.max_length` tokens per step: tokens per second, and the memory the timed steps took
    beyond what the trainer held after its first step (weights, optimizer state: on a CPU, the resident set's
    growth), per token of the row. Under sequence parallelism (several processes, each a slice of the row): the
    row's tokens per second, and the memory of rank 0, the one that reports."""
    from transformers import TrainerCallback

    from sft.run.build import build

    device = "cuda" if on_gpu() else "cpu"

    class AfterTheFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.baseline = memory_reset(device)

    trainer = build(cfg, scratch_dir("long-rows")).trainer
    collator = trainer.data_collator = CountingCollator(trainer.data_collator)
    clock, first = step_clock(), AfterTheFirstStep()
    trainer.add_callback(first)
    trainer.add_callback(clock)
    trainer.train()
    grown = memory_peak(device) - first.baseline
    row = max(collator.tokens)
    seconds = clock.times[-1] - clock.times[0]
    return {"tokens_per_second": sum(collator.tokens[1:len(clock.times)]) / seconds, "row_tokens": row,
            "memory_gb": grown, "bytes_per_token": grown * 2**30 / row, "on_gpu": device == "cuda",
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def drive_long_rows(context) -> tuple[dict, dict]:
    """Each length of `b.long_row_lengths` in one packed row per step, plain, with activation checkpointing, with
    tiled MLPs too and (on a GPU) offloaded checkpoints too, each in a process of its own:
    {variant: {length: result}}; no ratios."""
    import torch

    base, compose, spawn = context.base, context.compose, context.spawn
    b = base.bench
    timed = [o for o in timed_training_overrides(base) if not o.startswith(("trainer.max_steps=",
                                                                             "trainer.logging_steps="))]
    gpus = torch.cuda.device_count()
    variants = [v for v in LONG_ROW_VARIANTS if v in b.long_row_variants
                and (v != "offloaded" or gpus) and (not gpus or gpus >= LONG_ROW_PROCESSES.get(v, 1))]
    results: dict = {variant: {} for variant in variants}
    with tempfile.TemporaryDirectory(prefix="sft-bench-long-rows-") as tmp:
        for length in b.long_row_lengths:
            rows = Path(tmp, f"rows-{length}.jsonl")  # chats of about 150 tokens a turn, cut to the length
            multi_turn_rows(rows, b.long_row_steps + 1, turns=length // 100 + 1)
            for variant in variants:
                print(f"[long_rows] {variant} {length} tokens ...", file=sys.stderr, flush=True)
                extra = [o.format(tile=b.long_row_tile_tokens) for o in LONG_ROW_VARIANTS[variant]]
                cfg = compose(context.overrides + [
                    f"data.train_file={rows}", "data.eval_file=null", f"data.max_length={length}", "data.packing=true",
                    "loss=ce", "trainer.per_device_train_batch_size=1", "trainer.gradient_accumulation_steps=1", *timed,
                    f"trainer.max_steps={b.long_row_steps + 1}", "trainer.logging_steps=1",
                    "trainer.train_sampling_strategy=sequential", *extra])
                results[variant][str(length)] = spawn("long_rows", cfg, processes=LONG_ROW_PROCESSES.get(variant, 1))
    return results, {}


def show_long_rows(name: str, report: dict) -> list[str]:
    """Its lines in the printed report."""
    figures = report["cases"][name]
    lines = ["long rows     one packed row a step: tokens/s, and memory per token of the row (the step's peak over the "
             "built trainer's" + ("" if any(r["on_gpu"] for v in figures.values() for r in v.values())
                                  else ", the resident set's on a CPU") + ")"]
    for variant, by_length in figures.items():
        lines.append(f"  {variant:<18}" + "  ".join(f"{n:>6}: {r['tokens_per_second']:>8.0f} tok/s "
                                                     f"{r['bytes_per_token'] / 1024:>7.1f} KiB/token"
                                                     for n, r in by_length.items()))
    return lines
