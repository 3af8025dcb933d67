"""`python -m sft.bench [--out bench.json] [overrides]`: what this project's extra control costs, and what it gains.

Trains the same model on the same rows in the same order for `bench.steps` optimizer steps as
- `raw`: a hand-written PyTorch loop on sft's own batches (the model's logits, the assistant tokens' cross
  entropy, clipping, AdamW, the same schedule): the limit no framework can beat by much;
- `hf`: a plain `transformers.Trainer` with `DataCollatorForSeq2Seq` and the model's own loss;
- `ce_naive`: this project (`sft.run.build`, guard and clip policy included) computing the same full logits and
  cross entropy as `raw` and `hf` (`loss.impl=naive`): the framework's own cost;
- `ce`, `hard_sample`: this project with the lean loss `loss.impl=auto` picks (chunked on a CPU: only the
  assistant tokens are projected), and with the difficulty weights;
- `ce_bf16`: `ce` under bf16 autocast (`trainer.bf16=true`: fp32 weights cast to bf16 in every forward);
  `ce_bf16_pure`: the linear weights held in bf16 over the optimizer's fp32 copies (`trainer.precision=pure`); both
  on a CPU with bf16 instructions or a GPU, else skipped with one line; `ce_lora`: `ce` with `lora=default`
  (`ce_lora_naive`: with `loss.impl=naive`); `ce_compiled`: `ce` under torch.compile (on request: minutes);
- `packing`: `ce` with `data.packing=true` (the sdpa_varlen kernel); `ce_spread` and `packing_spread`: both on chats
  of a published dataset's length spread (LLaMA-Factory's alpaca_en_demo: 47 to 750 tokens, `sft.bench.rows`);
- `packing_flex`: `packing` on FlexAttention with the packed samples' document mask (`flex_attention`; on a GPU
  only, else skipped with one line); `packing_pure`: `packing` with `trainer.bf16=true trainer.precision=pure`
  (with `preset=gpu_7b`'s LoRA: the frozen base in bf16 only); `packing_compiled`: `packing` with each decoder layer
  compiled (`trainer.compile_layers=true`; on request); `packing_liger`: with Liger's RMSNorm, RoPE and SwiGLU
  (`trainer.use_liger_kernel=true`; on a GPU with liger-kernel, else skipped with one line; on request);
  `packing_flash`: on flash attention 2's varlen kernel (on a GPU with flash-attn, else skipped with one line; on
  request);
- `trl`, `trl_padding_free`, `trl_padding_free_mask`: TRL's `SFTTrainer` padded, padding-free on the same
  sdpa_varlen kernel as `packing`, and padding-free on its own kernel (a block-diagonal mask), all on `sft`'s own
  tokenised rows and labels with the model's own loss (tested: the same step losses as `sft` with `loss=ce`);
  skipped with one line when TRL is not installed (`pip install -e '.[bench]'`); `trl_best` and `hf_padding_free`
  (on request: the GPU pack's): TRL's SFTTrainer and a plain Trainer each at its own fastest documented settings
  (padding-free batches, TRL's or transformers' `DataCollatorWithFlattening`; `use_liger_kernel` on a GPU with
  liger-kernel; flash attention 2 where flash-attn is installed, else sdpa with the per-sample mask transformers reads
  from the position ids; the model's own loss; no activation checkpointing), tested to log sft's step losses;
- `packing_full` (on request): `packing` as a full fine-tune in pure bf16, of `bench.full_model` where set
  (`preset=gpu_7b`: Qwen2.5-1.5B's shape);
each at every micro-batch size of `bench.batch_sizes` (64, then the training default of 16: `ce_b16` ...);
times `Trainer.evaluate()` on the eval rows, a plain Trainer's (`eval_hf`) against this project's
(`eval_sft`), per 1,000 rows; and times the loss alone, forward and backward, on `bench.loss_batch x
bench.loss_seq` tokens at `bench.loss_vocab x bench.loss_hidden` (Qwen2.5's vocabulary): `loss_naive` (the
full logits, then the cross entropy) and `loss_lean` (the kernel training picks: Liger's on a GPU where installed,
chunked on a CPU); `loss_chunked`, `loss_cce`, `loss_liger` (on request) each kernel by name.

The ratios say what they measure: `sft_vs_raw` and `overhead_vs_hf` (the same loss computation on both sides),
`lean_loss_gain` (`ce` over `ce_naive`; `lean_loss_gain_lora` the same with LoRA), `hard_sample_vs_ce`,
`bf16_vs_fp32` (`ce_bf16_pure` over `ce`; `bf16_mixed_vs_fp32`: `ce_bf16` over `ce`; `pure_vs_mixed`),
`lora_vs_full` (`ce_lora` over `ce`), `compile_gain` (`ce_compiled` over `ce`), `packing_gain` (`packing` over
`ce`), `packing_gain_spread` (the same on the spread), `ce_vs_trl`, `packing_vs_trl_padding_free` (the same kernel)
and, apart, `varlen_vs_mask_kernel` (TRL padding-free on the two kernels), `flex_vs_varlen` (`packing_flex` over
`packing`), `packing_pure_vs_mixed` (`packing_pure` over `packing`), `compile_layers_gain` (`packing_compiled` over
`packing`), `liger_layers_gain` (`packing_liger` over `packing`), `flash_vs_varlen` (`packing_flash` over
`packing`), `packing_vs_trl_best` and
`packing_vs_hf_padding_free` (sft's packed run over each trainer at its fastest), and where the GPU's peak is known
`mfu_packing` and `mfu_packing_full` (executed FLOPs; `mfu_6n_<case>`, the 6N convention's). Each case runs in a
fresh process with the same torch threads (`bench.threads`) and, on a CPU, the same
allocator settings (`sft.training.processes.distributed.reuse_freed_memory`), so peak memory is its own (on a CPU: the
whole process's peak resident memory, imports and data included). The rounds interleave the cases, every other round in
reverse order, and repeat `bench.repeats` times; a ratio is the median of its per-round ratios, with their spread. Each
round records the load average, wall and CPU time; a round in which a training case got less than `bench.min_cpu_share`
of its threads' time is loaded: flagged and run again (`bench.reruns`). Training cases are timed from the end of step
`bench.warmup_steps` to the last step: input tokens (padding excluded) per second.

Also: `preprocess`, tokenising `bench.preprocess_rows` rows into a fresh cache and then loading them
from it; `tokenize`, the same `bench.tokenize_rows` multi-turn rows (about 300 tokens each) tokenised in
one process by `sft.data.labels.tokenize_batch`, by sft 0.1's (`sft.bench.baseline`) and by the tokenizer's own
`apply_chat_template(tokenize=True)` (the target: `tokenize_vs_tokenizer`), interleaved, one core each, beside the
tokenizer alone on the texts rendered beforehand; `scale`, preprocessing `bench.scale_rows` such rows into a fresh
cache on every core (rows/s, the peak resident memory of the process and of its largest worker), then loading them
from the cache, and with each of `bench.scale_processes` processes; `startup`, the median wall time of
`python -m sft.train --cfg job`, `--help` and `--help loss loss=focal`, and of the default run from the command to
its first optimizer step (`startup_first_step_s`, warm caches); `checksums` (only when named), a 15 GB
checkpoint's CRC-32s from the page cache and from the disk; `stream` (only when named), `bench.stream_read` sequences
read as `data.streaming=true` reads them from files of each of `bench.stream_rows` rows (the target: the peak memory
with the largest file within 1.2x the smallest's); `checkpoint_memory` (only when named), each rank's peak
memory while a 2-process FSDP2 full fine-tune saves a checkpoint, gathered and sharded (`sft.bench.checkpoint_memory`;
the target: rank 0's, sharded, within its share of the checkpoint); `long_rows` (only when named), one row a step of
each of `bench.long_row_lengths` tokens, plain, checkpointed, with tiled MLPs, (GPU) offloaded checkpoints and
each row split over 2 processes (`sp=ulysses`): tokens/s and memory per token (docs/long_context.md).

`matmul` times `torch.mm` over the model's own linear layers' shapes (`bench.matmul_tokens` rows each, the same
threads) in the model's dtype, `matmul_bf16` in bf16: the rate a step made of nothing but its matrix products would
reach here. Each round reads it anew; the limit is the best reading of the run (the machine's rate moves between
rounds: its spread is reported). Each training case is held to the limit of the dtype it trains in:
`hw_exec_<case>`, the FLOP/s of the products its step executes (`sft.training.observability.throughput.flops_per_token`:
the output layer only at the positions whose logits are computed, LoRA's own products, frozen weights without their
gradient) over the limit, and `hw_model_<case>`, the MFU convention's 6N per token plus attention over the same limit
(`model_flops_per_token`): the CPU's analogues of MFU, measured rather than taken from a data sheet.
`bench.train_rows=multi_turn` trains every case on chats of about 300 tokens.

`preset=smollm2` runs the training cases on the real model (SmolLM2-135M-Instruct) on such chats, with `matmul`
and `matmul_bf16`. `preset=qwen_vocab` trains `packing` and `trl_padding_free` with Qwen2.5's 151,936-token
vocabulary on the tiny model's body, where the output layer weighs as in real fine-tuning. `preset=gpu_7b` is the GPU
check: LoRA on a randomly initialised model of Qwen2.5-7B's shape, bf16, packed rows of about 4k tokens, the lean
loss, beside TRL and a plain Trainer at their fastest and a full fine-tune of Qwen2.5-1.5B's shape (see
sft/conf/preset/gpu_7b.yaml). While it runs, the results so far stand in `<out>.partial` (after each case): a run
stopped by a time limit keeps what it measured (`sft.bench.report.read_partial`).

The overrides are the training config's (`loss.impl=naive`, `trainer.per_device_train_batch_size=8`,
`model=...`), plus `bench.*`. Prints a table and writes the raw numbers and ratios to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from sft.bench.cases import (CASE_OVERRIDES, EVAL_CASES, LONG_ROW_PROCESSES, LONG_ROW_VARIANTS, RESULT,
                             FLASH_CASES, GPU_CASES, LIGER_CASES, SPREAD_CASES, TRAINING_CASES, TRL_CASES, child,
                             timed_training_overrides)
from sft.bench.checkpoint_memory import run_checkpoint_memory
from sft.bench.config import TRAINING_RATIOS, compose
from sft.bench.device import bf16_missing, flash_missing, gpu_missing, liger_missing
from sft.bench.loss_cases import LOSS_CASES, LOSS_KERNEL_CASES
from sft.bench.matmul import MATMUL_CASES
from sft.bench.report import breakdowns, hardware_ratios, print_report, write_partial
from sft.bench.rows import multi_turn_rows, spread_rows, synthetic_rows
from sft.bench.startup import startup_times
from sft.config.schema import ConfigError
from sft.config.validate import check

TARGETS = {  # ratio: (target, "min" if it must be at least the target, "max" if at most)
    "sft_vs_raw": (0.95, "min"),
    "overhead_vs_hf": (0.97, "min"),
    "hard_sample_vs_ce": (0.97, "min"),
    "packing_gain": (1.3, "min"),
    "packing_gain_spread": (1.3, "min"),
    "bf16_vs_fp32": (1.8, "min"),
    "lora_vs_full": (1.25, "min"),
    "hw_exec_ce": (0.80, "min"),
    "hw_exec_ce_bf16": (0.60, "min"),
    "ce_vs_trl": (1.0, "min"),
    "packing_vs_trl_padding_free": (1.3, "min"),
    "packing_vs_trl_best": (1.3, "min"),
    "mfu_packing": (0.40, "min"),
    "mfu_packing_full": (0.40, "min"),
    "lean_vs_naive_loss_memory": (0.3, "max"),
    "lean_vs_naive_loss_time": (1.3, "max"),
    "preprocess_cached_speedup": (10.0, "min"),
    "tokenize_vs_tokenizer": (0.9, "min"),
    "scale_peak_rss_gb": (4.0, "max"),
    "scale_cached_load_s": (10.0, "max"),
    "startup_cfg_job_s": (1.0, "max"),
    "startup_help_s": (1.0, "max"),
    "startup_help_group_s": (1.0, "max"),
    "startup_first_step_s": (5.0, "max"),
    "checkpoint_rank0_vs_share": (1.0, "max"),
    "stream_peak_rss_ratio": (1.2, "max"),
}


# --- the driver --------------------------------------------------------------------------------------


def spawn(case: str, cfg, env: dict | None = None, processes: int = 1) -> dict:
    """Run one case in a fresh process (the same threads for every case), or in `processes` of them under torchrun
    (the cores shared out); its result, or why it failed."""
    from sft.bench.cases import run_case, threads

    if not cfg.bench.isolate and processes == 1 and case in (*TRAINING_CASES, *EVAL_CASES, "long_rows"):
        return json.loads(json.dumps(run_case(case, cfg)))  # in this process (as JSON, like a child's result)
    env = {"OMP_NUM_THREADS": str(max(1, threads(cfg) // processes)), **(env or {})}  # (the children share them too)
    launcher = [] if processes == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                                          f"--master_port={free_port()}"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(cfg))
    try:
        proc = subprocess.run([sys.executable, *launcher, "-m", "sft.bench", "--case", case, "--config", f.name],
                              capture_output=True, text=True, timeout=cfg.bench.case_timeout_s,
                              env={**os.environ, **(env or {})})
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise RuntimeError(f"bench case {case} failed (exit {proc.returncode}):\n{tail}")


def free_port() -> int:
    """A TCP port nothing listens on now (torchrun's rendezvous for a case in several processes)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


BF16_CASES = ("ce_bf16", "ce_bf16_pure", "packing_pure", "packing_full", "matmul_bf16")
MFU_CASES = ("packing", "packing_full")  # the pack's sft cases whose MFU has a target (`mfu_<case>`)


def trl_missing() -> str | None:
    """Why the TRL cases cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[bench]')"
    return None


def case_id(case: str, batch_size: int, first: int) -> str:
    """A training case's name in the report: `ce` at the first of `bench.batch_sizes`, `ce_b16` at 16."""
    return case if batch_size == first else f"{case}_b{batch_size}"


def paired(rounds: list[dict], ours: str, theirs: str, key: str = "tokens_per_second") -> list[float]:
    """`ours[key] / theirs[key]` in each round where both ran: the ratio of two cases measured side by side."""
    return [r[ours][key] / r[theirs][key] for r in rounds if ours in r and theirs in r]


def training_ratios(rounds: list[dict], suffix: str) -> dict[str, list[float]]:
    """Each ratio of `TRAINING_RATIOS` among the training cases of one batch size, per round (and peak memory
    against TRL's cases)."""
    ratios = {}
    for name, (ours, theirs) in TRAINING_RATIOS.items():
        if values := paired(rounds, ours + suffix, theirs + suffix):
            ratios[name + suffix] = values
            if theirs.startswith("trl") or name.startswith("lean_loss_gain"):  # what the lean loss saves, too
                ratios[f"{name}_memory{suffix}"] = paired(rounds, ours + suffix, theirs + suffix, "peak_memory_gb")
    return ratios


def target_of(key: str):
    """The target of a ratio; one measured at another batch size (`_b16`) has its base ratio's."""
    base = key.rsplit("_b", 1)[0] if key.rsplit("_b", 1)[-1].isdigit() else key
    return TARGETS.get(base)


def run_rounds(jobs: dict, b, report: dict, partial: Path | None = None) -> list[dict]:
    """`b.repeats` rounds over every job, in turn (every other round in reverse order); each round's load average
    and, on a CPU, the least CPU share a training case got (`report["rounds"]`). A loaded round (a share below
    `b.min_cpu_share`) is run again, at most `b.reruns` times, and kept flagged if it stays loaded. After each case,
    every result so far is written to `partial` (a run stopped by a time limit keeps what it measured)."""
    rounds = []
    report.setdefault("failed", {})
    for number in range(1, b.repeats + 1):
        for attempt in range(b.reruns + 1):
            load = os.getloadavg()[0]
            results = {}
            # every other round in reverse order: a machine that speeds up or slows down over a round (it does,
            # here) then favours no case; a ratio's paired rounds see each of its cases first as often
            order = list(jobs.items()) if number % 2 else list(jobs.items())[::-1]
            for name, (case, cfg) in order:
                if name in report["failed"]:
                    continue
                print(f"[round {number}/{b.repeats}] {name} ...", file=sys.stderr, flush=True)
                try:
                    results[name] = spawn(case, cfg)
                except RuntimeError as e:  # one case's fault (a kernel that fails here): said; the others run on
                    report["failed"][name] = str(e)
                    print(f"[round {number}/{b.repeats}] {name} failed: {e}", file=sys.stderr, flush=True)
                if partial is not None:
                    write_partial(partial, report, rounds + [results])
            shares = [r["cpu_share"] for r in results.values() if "cpu_share" in r]
            info = {"round": number, "attempt": attempt + 1, "load_before": load, "load_after": os.getloadavg()[0],
                    "min_cpu_share": min(shares) if shares else None,
                    "loaded": bool(shares) and min(shares) < b.min_cpu_share}
            if not info["loaded"] or attempt == b.reruns:
                break
            print(f"[round {number}/{b.repeats}] loaded: a training case got {min(shares):.0%} of its threads' time "
                  "(other work took cores); running the round again", file=sys.stderr, flush=True)
        rounds.append(results)
        report["rounds"].append(info)
    for results in rounds:  # a case that failed in any round is in none: its figures are not comparable
        for name in report["failed"]:
            results.pop(name, None)
    return rounds


def run_all(overrides: list[str], partial: Path | None = None) -> dict:
    """Every case of `bench.cases`, interleaved and repeated; the raw numbers, medians and ratios (and, after each
    case, the results so far in `partial`)."""
    base = compose(overrides)
    check(base)  # the bench's node and the training config it runs, as python -m sft.train checks them
    b = base.bench
    report: dict = {"overrides": overrides, "raw": {}, "cases": {}, "ratios": {}, "spread": {}, "rounds": [],
                    "skipped": {}, "failed": {}, "isolated": bool(base.bench.isolate)}
    wanted = list(b.cases)
    for group, reason in ((TRL_CASES, trl_missing()), (BF16_CASES, bf16_missing()), (GPU_CASES, gpu_missing()),
                          (LIGER_CASES, liger_missing()), (FLASH_CASES, flash_missing())):
        if reason and any(case in group for case in wanted):
            print(f"skipping {', '.join(c for c in wanted if c in group)}: {reason}", file=sys.stderr)
            report["skipped"].update({case: reason for case in wanted if case in group})
            wanted = [case for case in wanted if case not in group]
    jobs = {}  # case id -> (case, config)
    batch_sizes = list(b.batch_sizes or [base.trainer.per_device_train_batch_size])
    rows_dir = tempfile.TemporaryDirectory(prefix="sft-bench-rows-")
    rows = []
    if b.train_rows == "multi_turn":  # chats of about 300 tokens, as real fine-tuning data has them
        multi_turn_rows(path := Path(rows_dir.name, "multi_turn.jsonl"), b.train_row_count)
        rows = [f"data.train_file={path}"]
    if any(case in SPREAD_CASES for case in wanted):
        spread_rows(spread := Path(rows_dir.name, "spread.jsonl"), b.train_row_count)
    for size in batch_sizes:
        for case in wanted:
            if case in TRAINING_CASES:
                case_rows = [f"data.train_file={spread}"] if case in SPREAD_CASES else rows
                model = [f"model={b.full_model}"] if case == "packing_full" and b.full_model else []
                cfg = compose(overrides + case_rows + model + CASE_OVERRIDES[case] + timed_training_overrides(base)
                              + [f"trainer.per_device_train_batch_size={size}"])
                jobs[case_id(case, size, batch_sizes[0])] = (case, cfg)
    evaluation = compose(overrides + ["loss=ce", "trainer.report_to=[]", "trainer.disable_tqdm=true"])
    jobs.update({case: (case, evaluation) for case in wanted if case in EVAL_CASES})
    jobs.update({case: (case, base) for case in wanted if case in (*LOSS_CASES, *LOSS_KERNEL_CASES, *MATMUL_CASES)})
    with rows_dir:
        rounds = run_rounds(jobs, b, report, partial) if jobs else []
    for name in (name for name in jobs if name not in report["failed"]):
        runs = [r[name] for r in rounds]
        report["raw"][name] = runs
        report["cases"][name] = {key: statistics.median(run[key] for run in runs)
                                 for key in runs[0] if isinstance(runs[0][key], (int, float))}
    cases, per_round = report["cases"], {}
    for size in batch_sizes:
        per_round.update(training_ratios(rounds, case_id("", size, batch_sizes[0])))
    per_round.update(hardware_ratios(rounds, cases))
    for case in MFU_CASES:  # known where the peak is (a GPU the table names, or throughput.peak_tflops)
        if "mfu" in cases.get(case, {}):
            per_round[f"mfu_{case}"] = [r[case]["mfu"] for r in rounds if case in r]
            per_round[f"mfu_6n_{case}"] = [r[case]["mfu_6n"] for r in rounds if case in r]
    breakdowns(rounds, cases)
    if all(case in cases for case in EVAL_CASES):
        per_round["eval_vs_hf_time"] = paired(rounds, "eval_sft", "eval_hf", "seconds_per_1000_rows")
    if all(case in cases for case in LOSS_CASES):
        per_round["lean_vs_naive_loss_memory"] = paired(rounds, "loss_lean", "loss_naive", "peak_memory_gb")
        per_round["lean_vs_naive_loss_time"] = paired(rounds, "loss_lean", "loss_naive", "seconds")
    for case, kernel in LOSS_KERNEL_CASES.items():  # a kernel not usable here ran another: no ratio in its name
        if case in cases and "loss_naive" in cases and report["raw"][case][0]["impl"] == kernel:
            per_round[f"{kernel}_vs_naive_loss_memory"] = paired(rounds, case, "loss_naive", "peak_memory_gb")
            per_round[f"{kernel}_vs_naive_loss_time"] = paired(rounds, case, "loss_naive", "seconds")
    ratios = report["ratios"]
    for key, values in per_round.items():
        ratios[key] = statistics.median(values)
        report["spread"][key] = [min(values), max(values)]
    if "preprocess" in b.cases:
        with tempfile.TemporaryDirectory(prefix="sft-bench-preprocess-") as tmp:
            env = {"SFT_CACHE": str(Path(tmp, "cache"))}  # cold: nothing cached yet
            few, rows = Path(tmp, "few.jsonl"), Path(tmp, "rows.jsonl")
            synthetic_rows(few, 10)
            synthetic_rows(rows, b.preprocess_rows)
            # Untimed: builds the tiny model (the tokenizer) into the fresh cache, on 10 rows.
            spawn("preprocess", compose(overrides + [f"data.train_file={few}", "data.eval_file=null"]), env)
            cfg = compose(overrides + [f"data.train_file={rows}", "data.eval_file=null"])
            cold = spawn("preprocess", cfg, env)
            warm = spawn("preprocess", cfg, env)
        cases["preprocess"] = {"rows": cold["rows"], "first_s": cold["seconds"], "cached_s": warm["seconds"]}
        ratios["preprocess_cached_speedup"] = cold["seconds"] / warm["seconds"]
    multi_turn = ["data.eval_file=null", "data.max_length=1024"]
    if "tokenize" in b.cases:
        with tempfile.TemporaryDirectory(prefix="sft-bench-tokenize-") as tmp:
            multi_turn_rows(rows := Path(tmp, "rows.jsonl"), b.tokenize_rows)
            # one core each: the tokenizer's own threads would blur the per-row comparison
            tokenized = spawn("tokenize", compose(overrides + multi_turn + [f"data.train_file={rows}"]),
                              {"TOKENIZERS_PARALLELISM": "false"})
        cases["tokenize"] = tokenized
        # sft's rows/s over: the tokenizer's own chat path (rendering and encoding, the least any labelling does:
        # the target), the encoding of texts rendered beforehand (no chat work at all), sft 0.1's labelling
        for ratio, versus in (("tokenize_vs_tokenizer", "vs_chat"), ("tokenize_vs_encode", "vs_tokenizer"),
                              ("tokenize_vs_baseline", "vs_baseline")):
            values = tokenized["round_ratios"][versus]
            ratios[ratio], report["spread"][ratio] = statistics.median(values), [min(values), max(values)]
    if "scale" in b.cases:
        with tempfile.TemporaryDirectory(prefix="sft-bench-scale-") as tmp:
            env = {"SFT_CACHE": str(Path(tmp, "cache"))}
            few, rows = Path(tmp, "few.jsonl"), Path(tmp, "rows.jsonl")
            multi_turn_rows(few, 10)
            multi_turn_rows(rows, b.scale_rows)
            spawn("preprocess", compose(overrides + multi_turn + [f"data.train_file={few}"]), env)  # the tiny model
            cfg = compose(overrides + multi_turn + [f"data.train_file={rows}"])
            cold = spawn("scale", cfg, env)
            warm = spawn("scale", cfg, env)
            for n in b.scale_processes or []:  # each into a fresh cache of its own
                run = spawn("scale", compose(overrides + multi_turn + [f"data.train_file={rows}",
                                                                       f"data.num_proc={n}"]),
                            {"SFT_CACHE": str(Path(tmp, f"cache-{n}"))})
                ratios[f"scale_rows_per_second_{n}p"] = b.scale_rows / run["seconds"]
        cases["scale"] = {"rows": cold["rows"], "rows_per_second": b.scale_rows / cold["seconds"],
                          "first_s": cold["seconds"], "peak_rss_gb": cold["peak_rss_gb"],
                          "worker_peak_rss_gb": cold["worker_peak_rss_gb"], "cached_s": warm["seconds"],
                          "cached_peak_rss_gb": warm["peak_rss_gb"]}
        ratios["scale_peak_rss_gb"] = max(cold["peak_rss_gb"], cold["worker_peak_rss_gb"])
        ratios["scale_cached_load_s"] = warm["seconds"]
    if "checksums" in b.cases:
        cases["checksums"] = c = spawn("checksums", base)
        ratios["checksum_cached_gb_per_s"] = c["gb"] / c["cached_s"]
        if c["disk_s"] is not None:
            ratios["checksum_disk_gb_per_s"] = c["gb"] / c["disk_s"]
    if "long_rows" in b.cases:
        cases["long_rows"] = long_rows(overrides, base)
    if "stream" in b.cases:
        with tempfile.TemporaryDirectory(prefix="sft-bench-stream-") as tmp:
            results = {}
            for n in b.stream_rows:
                synthetic_rows(rows := Path(tmp, f"rows-{n}.jsonl"), n)
                results[n] = spawn("stream", compose(overrides + [f"data.train_file={rows}", "data.eval_file=null",
                                                                  "data.streaming=true", "trainer.max_steps=1"]))
                rows.unlink()
        cases["stream"] = {str(n): r for n, r in results.items()}
        small, large = min(results), max(results)
        ratios["stream_peak_rss_ratio"] = results[large]["peak_rss_gb"] / results[small]["peak_rss_gb"]
        ratios["stream_sequences_per_second"] = results[large]["sequences"] / results[large]["seconds"]
    if "checkpoint_memory" in b.cases:
        cases["checkpoint_memory"] = c = run_checkpoint_memory(overrides, b.case_timeout_s, free_port)
        # rank 0's peak above its step's, saving sharded, over its share of the checkpoint; and gathered over sharded
        ratios["checkpoint_rank0_vs_share"] = c["sharded"]["rank_mib"][0] / c["share_mib"]
        ratios["checkpoint_rank0_gathered_mib"] = c["gathered"]["rank_mib"][0]
        ratios["checkpoint_rank0_sharded_mib"] = c["sharded"]["rank_mib"][0]
    if "startup" in b.cases:
        ratios.update(startup_times(b.startup_repeats))
    report["targets"] = {}
    for key, value in ratios.items():
        if (target := target_of(key)) is not None:
            t, kind = target
            report["targets"][key] = {"target": t, "kind": kind, "met": value >= t if kind == "min" else value <= t}
    return report


def long_rows(overrides: list[str], base) -> dict:
    """Each length of `b.long_row_lengths` in one packed row per step, plain, with activation checkpointing, with
    tiled MLPs too and (on a GPU) offloaded checkpoints too, each in a process of its own:
    {variant: {length: result}}."""
    import torch

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
                cfg = compose(overrides + [f"data.train_file={rows}", "data.eval_file=null", f"data.max_length={length}",
                                           "data.packing=true", "loss=ce", "trainer.per_device_train_batch_size=1",
                                           "trainer.gradient_accumulation_steps=1", *timed,
                                           f"trainer.max_steps={b.long_row_steps + 1}", "trainer.logging_steps=1",
                                           "trainer.train_sampling_strategy=sequential", *extra])
                results[variant][str(length)] = spawn("long_rows", cfg, processes=LONG_ROW_PROCESSES.get(variant, 1))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sft.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench.json", help="where to write the raw numbers and ratios")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.case:
        child(args.case, args.config)
        return 0
    from hydra.errors import HydraException

    from sft.config.argv import composition_error

    partial = Path(args.out + ".partial")  # the results so far, while it runs (`write_partial`)
    try:
        report = run_all(overrides, partial)
    except ConfigError as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    except HydraException as e:  # an override that does not compose: one line, as python -m sft.train says it
        print(f"error: config: {composition_error(e, overrides, compose) or str(e).splitlines()[0]}",
              file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    partial.unlink(missing_ok=True)
    print_report(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
