"""`python -m sft.bench [--out bench.json] [overrides]`: what this project's extra control costs, and what it gains.

Trains the same model on the same rows in the same order for `bench.steps` optimizer steps as
- `raw`: a hand-written PyTorch loop on sft's own batches (the model's logits, the assistant tokens' cross
  entropy, clipping, AdamW, the same schedule): the limit no framework can beat by much;
- `hf`: a plain `transformers.Trainer` with `DataCollatorForSeq2Seq` and the model's own loss;
- `ce_naive`: this project (`sft.run.build`, guard and clip policy included) computing the same full logits and
  cross entropy as `raw` and `hf` (`loss.impl=naive`): the framework's own cost;
- `ce`, `hard_sample`: this project with the lean loss `loss.impl=auto` picks (chunked on a CPU: only the
  assistant tokens are projected), and with the difficulty weights;
- `packing`: `ce` with `data.packing=true` (the sdpa_varlen kernel);
- `trl`, `trl_padding_free`, `trl_padding_free_mask`: TRL's `SFTTrainer` padded, padding-free on the same
  sdpa_varlen kernel as `packing`, and padding-free on its own kernel (a block-diagonal mask), all on `sft`'s own
  tokenised rows and labels with the model's own loss (tested: the same step losses as `sft` with `loss=ce`);
  skipped with one line when TRL is not installed (`pip install -e '.[bench]'`);
each at every micro-batch size of `bench.batch_sizes` (64, then the training default of 16: `ce_b16` ...);
times `Trainer.evaluate()` on the eval rows, a plain Trainer's (`eval_hf`) against this project's
(`eval_sft`), per 1,000 rows; and times the loss alone, forward and backward, on `bench.loss_batch x
bench.loss_seq` tokens at `bench.loss_vocab x bench.loss_hidden` (Qwen2.5's vocabulary): `loss_naive` (the
full logits, then the cross entropy) and `loss_lean` (the kernel training picks: cut-cross-entropy on a GPU,
chunked on a CPU).

The ratios say what they measure: `sft_vs_raw` and `overhead_vs_hf` (the same loss computation on both sides),
`lean_loss_gain` (`ce` over `ce_naive`), `hard_sample_vs_ce`, `packing_gain` (`packing` over `ce`), `ce_vs_trl`,
`packing_vs_trl_padding_free` (the same kernel) and, apart, `varlen_vs_mask_kernel` (TRL padding-free on the two
kernels). Each case runs in a fresh process with the same torch threads (`bench.threads`) and, on a CPU, the same
allocator settings (`sft.training.distributed.reuse_freed_memory`), so peak memory is its own (on a CPU: the whole
process's peak resident memory, imports and data included). The rounds interleave the cases, every other round
in reverse order, and repeat `bench.repeats` times; a ratio is the median of its per-round ratios, with their
spread. Each round records the load average, wall and CPU time; a round in which a training case got less than
`bench.min_cpu_share` of its threads' time is loaded: flagged and run again (`bench.reruns`). Training cases are
timed from the end of step `bench.warmup_steps` to the last step: input tokens (padding excluded) per second.

Also: `preprocess`, tokenising `bench.preprocess_rows` rows into a fresh cache and then loading them
from it; `tokenize`, the same `bench.tokenize_rows` multi-turn rows (about 300 tokens each) tokenised in
one process by `sft.data.labels.tokenize_batch` and by sft 0.1's (`sft.bench.baseline`), interleaved, one core
each, beside the tokenizer alone on the same texts (what no labelling can go below); `scale`, preprocessing
`bench.scale_rows` such rows into a fresh cache on every core (rows/s, the peak resident memory of the
process and of its largest worker), then loading them from the cache; `startup`, the median wall time of
`python -m sft.train --cfg job`, `--help` and `--help loss loss=focal`, and of the default run from the command to
its first optimizer step (`startup_first_step_s`, warm caches); `checksums` (only when named), a 15 GB
checkpoint's CRC-32s from the page cache and from the disk; `long_rows` (only when named), one row a step of
each of `bench.long_row_lengths` tokens, plain, checkpointed, with tiled MLPs, (GPU) offloaded checkpoints and
each row split over 2 processes (`sp=ulysses`): tokens/s and memory per token (docs/long_context.md).

`matmul` times `torch.mm` over the model's own linear layers' shapes (`bench.matmul_tokens` rows each, the same
threads): the rate a step made of nothing but its matrix products would reach here. With it, each training case gets
`hw_limit_<case>`: its training FLOP/s (6N per token for full fine-tuning, about 4N with LoRA, plus attention:
`sft.training.throughput.flops_per_token`) over that rate, round by round: the CPU's analogue of MFU, measured
rather than taken from a data sheet. `bench.train_rows=multi_turn` trains every case on chats of about 300 tokens.

`preset=smollm2` runs the training cases on the real model (SmolLM2-135M-Instruct) on such chats, with `matmul`
(full fine-tuning; add `lora=default` for LoRA). `preset=qwen_vocab` trains `packing` and `trl_padding_free` with Qwen2.5's 151,936-token vocabulary on the tiny
model's body, where the output layer weighs as in real fine-tuning. `preset=gpu_7b` is the GPU check: LoRA on a
randomly initialised model of Qwen2.5-7B's shape, bf16, packed rows of about 4k tokens, the lean loss, 20 steps
(see sft/conf/preset/gpu_7b.yaml).

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
import time
from pathlib import Path

from omegaconf import OmegaConf

from sft.bench.cases import (CASE_OVERRIDES, EVAL_CASES, LONG_ROW_PROCESSES, LONG_ROW_VARIANTS, LOSS_CASES, MATMUL,
                             RESULT, TRAINING_CASES, TRL_CASES, child, timed_training_overrides)
from sft.bench.rows import multi_turn_rows, synthetic_rows
from sft.bench.config import compose
from sft.config.schema import ConfigError
from sft.config.validate import check

TARGETS = {  # ratio: (target, "min" if it must be at least the target, "max" if at most)
    "sft_vs_raw": (0.95, "min"),
    "overhead_vs_hf": (0.97, "min"),
    "hard_sample_vs_ce": (0.97, "min"),
    "packing_gain": (1.3, "min"),
    "ce_vs_trl": (1.0, "min"),
    "packing_vs_trl_padding_free": (1.3, "min"),
    "lean_vs_naive_loss_memory": (0.3, "max"),
    "lean_vs_naive_loss_time": (1.3, "max"),
    "preprocess_cached_speedup": (10.0, "min"),
    "tokenize_vs_baseline": (3.0, "min"),
    "scale_peak_rss_gb": (4.0, "max"),
    "scale_cached_load_s": (10.0, "max"),
    "startup_cfg_job_s": (1.0, "max"),
    "startup_help_s": (1.0, "max"),
    "startup_help_group_s": (1.0, "max"),
    "startup_first_step_s": (5.0, "max"),
}
# name: (ours, theirs): tokens per second of `ours` over `theirs`, at each batch size; "_memory" too against TRL
TRAINING_RATIOS = {"sft_vs_raw": ("ce_naive", "raw"), "overhead_vs_hf": ("ce_naive", "hf"),
                   "lean_loss_gain": ("ce", "ce_naive"), "hard_sample_vs_ce": ("hard_sample", "ce"),
                   "packing_gain": ("packing", "ce"), "ce_vs_trl": ("ce", "trl"),
                   "packing_vs_trl_padding_free": ("packing", "trl_padding_free"),
                   "varlen_vs_mask_kernel": ("trl_padding_free", "trl_padding_free_mask")}


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


def startup_seconds(*args: str, repeats: int = 5) -> float:
    """Wall time of `python -m sft.train args...`: the median of `repeats` runs."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sft.train", *args], capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_step_seconds(repeats: int = 5) -> float:
    """Wall time of the default run (`python -m sft.train`, no overrides but these) trained for one step,
    with no evaluation or checkpoint: from the command to the first optimizer step, plus saving the tiny
    model. Caches are warmed by one untimed run; the median of `repeats`."""
    times = []
    one_step = ["trainer.max_steps=1", "trainer.eval_strategy=no", "trainer.save_strategy=no", "trainer.report_to=[]"]
    with tempfile.TemporaryDirectory(prefix="sft-bench-first-step-") as tmp:
        for n in range(repeats + 1):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sft.train", *one_step, f"hydra.run.dir={tmp}/{n}"],
                           capture_output=True, check=True)
            if n:  # the first run warms the caches (tiny model, tokenised data)
                times.append(time.perf_counter() - started)
    return statistics.median(times)


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
            if theirs.startswith("trl"):
                ratios[f"{name}_memory{suffix}"] = paired(rounds, ours + suffix, theirs + suffix, "peak_memory_gb")
    return ratios


def target_of(key: str):
    """The target of a ratio; one measured at another batch size (`_b16`) has its base ratio's."""
    base = key.rsplit("_b", 1)[0] if key.rsplit("_b", 1)[-1].isdigit() else key
    return TARGETS.get(base)


def run_rounds(jobs: dict, b, report: dict) -> list[dict]:
    """`b.repeats` rounds over every job, in turn (every other round in reverse order); each round's load average
    and, on a CPU, the least CPU share a training case got (`report["rounds"]`). A loaded round (a share below
    `b.min_cpu_share`) is run again, at most `b.reruns` times, and kept flagged if it stays loaded."""
    rounds = []
    for number in range(1, b.repeats + 1):
        for attempt in range(b.reruns + 1):
            load = os.getloadavg()[0]
            results = {}
            # every other round in reverse order: a machine that speeds up or slows down over a round (it does,
            # here) then favours no case; a ratio's paired rounds see each of its cases first as often
            order = list(jobs.items()) if number % 2 else list(jobs.items())[::-1]
            for name, (case, cfg) in order:
                print(f"[round {number}/{b.repeats}] {name} ...", file=sys.stderr, flush=True)
                results[name] = spawn(case, cfg)
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
    return rounds


def run_all(overrides: list[str]) -> dict:
    """Every case of `bench.cases`, interleaved and repeated; the raw numbers, medians and ratios."""
    base = compose(overrides)
    check(base)  # the bench's node and the training config it runs, as python -m sft.train checks them
    b = base.bench
    report: dict = {"overrides": overrides, "raw": {}, "cases": {}, "ratios": {}, "spread": {}, "rounds": [],
                    "skipped": {}, "isolated": bool(base.bench.isolate)}
    wanted = list(b.cases)
    if any(case in TRL_CASES for case in wanted) and (reason := trl_missing()):
        print(f"skipping {', '.join(c for c in wanted if c in TRL_CASES)}: {reason}", file=sys.stderr)
        report["skipped"].update({case: reason for case in wanted if case in TRL_CASES})
        wanted = [case for case in wanted if case not in TRL_CASES]
    jobs = {}  # case id -> (case, config)
    batch_sizes = list(b.batch_sizes or [base.trainer.per_device_train_batch_size])
    rows_dir = tempfile.TemporaryDirectory(prefix="sft-bench-rows-")
    rows = []
    if b.train_rows == "multi_turn":  # chats of about 300 tokens, as real fine-tuning data has them
        multi_turn_rows(path := Path(rows_dir.name, "multi_turn.jsonl"), b.train_row_count)
        rows = [f"data.train_file={path}"]
    for size in batch_sizes:
        for case in wanted:
            if case in TRAINING_CASES:
                cfg = compose(overrides + rows + CASE_OVERRIDES[case] + timed_training_overrides(base)
                              + [f"trainer.per_device_train_batch_size={size}"])
                jobs[case_id(case, size, batch_sizes[0])] = (case, cfg)
    evaluation = compose(overrides + ["loss=ce", "trainer.report_to=[]", "trainer.disable_tqdm=true"])
    jobs.update({case: (case, evaluation) for case in wanted if case in EVAL_CASES})
    jobs.update({case: (case, base) for case in wanted if case in (*LOSS_CASES, MATMUL)})
    with rows_dir:
        rounds = run_rounds(jobs, b, report) if jobs else []
    for name in jobs:
        runs = [r[name] for r in rounds]
        report["raw"][name] = runs
        report["cases"][name] = {key: statistics.median(run[key] for run in runs)
                                 for key in runs[0] if isinstance(runs[0][key], (int, float))}
    cases, per_round = report["cases"], {}
    for size in batch_sizes:
        per_round.update(training_ratios(rounds, case_id("", size, batch_sizes[0])))
    if MATMUL in cases:  # each training case's FLOP/s over the model's matrix products' rate, round by round
        for name in jobs:
            if values := [r[name]["achieved_gflops"] / r[MATMUL]["gflops"] for r in rounds
                          if "achieved_gflops" in r.get(name, {}) and MATMUL in r]:
                per_round[f"hw_limit_{name}"] = values
                cases[name]["hw_limit"] = statistics.median(values)
    if all(case in cases for case in EVAL_CASES):
        per_round["eval_vs_hf_time"] = paired(rounds, "eval_sft", "eval_hf", "seconds_per_1000_rows")
    if all(case in cases for case in LOSS_CASES):
        per_round["lean_vs_naive_loss_memory"] = paired(rounds, "loss_lean", "loss_naive", "peak_memory_gb")
        per_round["lean_vs_naive_loss_time"] = paired(rounds, "loss_lean", "loss_naive", "seconds")
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
        ratios["tokenize_vs_baseline"] = tokenized["sft_rows_per_second"] / tokenized["baseline_rows_per_second"]
        # the most any labelling could gain: tokenising the texts alone, against the baseline
        ratios["tokenizer_alone_vs_baseline"] = (tokenized["tokenizer_rows_per_second"]
                                                 / tokenized["baseline_rows_per_second"])
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
    if "startup" in b.cases:
        n = b.startup_repeats
        ratios["startup_cfg_job_s"] = startup_seconds("--cfg", "job", repeats=n)
        ratios["startup_help_s"] = startup_seconds("--help", repeats=n)
        ratios["startup_help_group_s"] = startup_seconds("--help", "loss", "loss=focal", repeats=n)
        ratios["startup_first_step_s"] = first_step_seconds(n)
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


def print_report(report: dict) -> None:
    cases = report["cases"]
    gpu = any("cpu_share" not in c for c in cases.values() if "tokens_per_second" in c)
    memory = "peak GiB" if gpu else "peak RSS"
    print(f"\n{'case':<26}{'tokens/s':>12}{'vs hf':>8}{memory:>10}{'vs hf':>8}{'cpu s':>8}{'mfu':>8}{'GFLOP/s':>9}"
          f"{'hw lim':>8}")
    for name, c in cases.items():
        if "tokens_per_second" not in c:
            continue
        suffix = name[len(name.rsplit("_b", 1)[0]):] if name.rsplit("_b", 1)[-1].isdigit() else ""
        hf = cases.get("hf" + suffix, {})
        print(f"{name:<26}{c['tokens_per_second']:>12.0f}"
              f"{c['tokens_per_second'] / hf['tokens_per_second'] if hf else float('nan'):>8.2f}"
              f"{c['peak_memory_gb']:>10.2f}"
              f"{c['peak_memory_gb'] / hf['peak_memory_gb'] if hf else float('nan'):>8.2f}"
              f"{c.get('cpu_seconds', float('nan')):>8.1f}{c['mfu'] if 'mfu' in c else float('nan'):>8.3f}"
              f"{c.get('achieved_gflops', float('nan')):>9.1f}{c.get('hw_limit', float('nan')):>8.3f}")
    if MATMUL in cases:
        m = cases[MATMUL]
        print(f"matmul: torch.mm over the model's products ({m['tokens']:.0f} rows each) at {m['gflops']:.1f} GFLOP/s "
              "on this machine; hw lim: a case's training FLOP/s over that rate (GFLOP/s: its 6N (full) or ~4N "
              "(LoRA) FLOPs per token plus attention, sft.training.throughput.flops_per_token)")
    if not gpu and any("tokens_per_second" in c for c in cases.values()):
        print("(memory on a CPU: each case's whole-process peak resident memory, imports and data included)"
              if report.get("isolated", True) else "(bench.isolate=false: the cases shared one process, so memory "
              "figures are that process's peak so far, not each case's own)")
    for case in EVAL_CASES:
        if case in cases:
            c = cases[case]
            print(f"{case:<22}{c['seconds_per_1000_rows']:>10.2f} s per 1,000 eval rows ({c['rows']} rows)")
    for case in LOSS_CASES:
        if case in cases:
            c = cases[case]
            impl = report["raw"][case][0]["impl"]
            print(f"{case:<22}{c['tokens'] / c['seconds']:>12.0f}{'':>8}{c['peak_memory_gb']:>10.2f}   "
                  f"({c['seconds']:.2f} s forward+backward, {impl})")
    if "preprocess" in cases:
        p = cases["preprocess"]
        print(f"preprocess    {p['rows']} rows: first {p['first_s']:.1f} s, cached {p['cached_s']:.2f} s")
    if "tokenize" in cases:
        t = cases["tokenize"]
        print(f"tokenize      {t['rows']} multi-turn rows, rows/s on one core: sft {t['sft_rows_per_second']:.0f} "
              f"({t['sft_renders_per_row']:g} renders a row), sft 0.1 {t['baseline_rows_per_second']:.0f} "
              f"({t['baseline_renders_per_row']:g}), the tokenizer alone {t['tokenizer_rows_per_second']:.0f}; "
              "rounds (sft, tokenizer alone vs sft 0.1): "
              + ", ".join(f"{ours:.2f}/{alone:.2f}" for ours, alone in t["round_ratios"]))
    if "scale" in cases:
        c = cases["scale"]
        print(f"scale         {c['rows']} rows: {c['rows_per_second']:.0f} rows/s ({c['first_s']:.0f} s), peak RSS "
              f"{c['peak_rss_gb']:.2f} GiB (largest worker {c['worker_peak_rss_gb']:.2f} GiB); cached load "
              f"{c['cached_s']:.1f} s ({c['cached_peak_rss_gb']:.2f} GiB)")
    if "checksums" in cases:
        c = cases["checksums"]
        disk = "not measured (cannot drop the page cache here)" if c["disk_s"] is None else f"{c['disk_s']:.1f} s"
        print(f"checksums     a {c['gb']:.0f} GB checkpoint: {c['cached_s']:.1f} s from the page cache (a save), "
              f"{disk} from the disk (a resume)")
    if "long_rows" in cases:
        print("long rows     one packed row a step: tokens/s, and memory per token of the row (the step's peak over "
              "the built trainer's" + ("" if any(r["on_gpu"] for v in cases["long_rows"].values() for r in v.values())
                                       else ", the resident set's on a CPU") + ")")
        for variant, by_length in cases["long_rows"].items():
            print(f"  {variant:<18}" + "  ".join(f"{n:>6}: {r['tokens_per_second']:>8.0f} tok/s "
                                                 f"{r['bytes_per_token'] / 1024:>7.1f} KiB/token"
                                                 for n, r in by_length.items()))
    for case, reason in report.get("skipped", {}).items():
        print(f"{case:<22}skipped: {reason}")
    for info in report.get("rounds", []):
        share = "" if info["min_cpu_share"] is None else f", least CPU share {info['min_cpu_share']:.0%}"
        flag = "  LOADED: its ratios are not to be trusted" if info["loaded"] else ""
        print(f"round {info['round']} (attempt {info['attempt']}): load average {info['load_before']:.1f} -> "
              f"{info['load_after']:.1f}{share}{flag}")
    print(f"\n{'ratio':<40}{'median':>8}  {'rounds (min-max)':<18}")
    for key, value in report["ratios"].items():
        target = report["targets"].get(key)
        spread = report.get("spread", {}).get(key)
        rounds = f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else ""
        mark = "" if target is None else (f"target {'>=' if target['kind'] == 'min' else '<='} {target['target']}: "
                                          f"{'met' if target['met'] else 'NOT MET'}")
        print(f"{key:<40}{value:>8.3f}  {rounds:<18}{mark}")


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

    try:
        report = run_all(overrides)
    except ConfigError as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    except HydraException as e:  # an override that does not compose: one line, as python -m sft.train says it
        print(f"error: config: {composition_error(e, overrides, compose) or str(e).splitlines()[0]}",
              file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
