"""`python -m sft.bench [--out bench.json] [overrides]`: what this project's extra control costs.

Trains the same model on the same rows in the same order for `bench.steps` optimizer steps as
- `hf`: a plain `transformers.Trainer` with `DataCollatorForSeq2Seq` and the model's own loss;
- `ce`, `hard_sample`: this project (`sft.train.build`, guard and clip policy included) with that loss;
- `packing`: `hard_sample` with `data.packing=true`;
- `trl`, `trl_padding_free`: TRL's `SFTTrainer` (padded, and its padding-free mode) on `sft`'s own tokenised
  rows and labels, so it trains on the same tokens with the same loss (tested); skipped with one line when
  TRL is not installed (`pip install -e '.[bench]'`);
each at every micro-batch size of `bench.batch_sizes` (64, then the training default of 16: `ce_b16` ...);
times `Trainer.evaluate()` on the eval rows, a plain Trainer's (`eval_hf`) against this project's
(`eval_sft`), per 1,000 rows; and times the loss alone, forward and backward, on `bench.loss_batch x
bench.loss_seq` tokens at `bench.loss_vocab x bench.loss_hidden` (Qwen2.5's vocabulary) with
- `loss_naive` (the full logits, then the cross entropy) and `loss_chunked` (`loss.impl=chunked`).
Each case runs in a fresh process, so peak memory is its own; the rounds interleave the cases and
repeat `bench.repeats` times, and the medians are compared. Training cases are timed from the end of
step `bench.warmup_steps` to the last step: input tokens (padding excluded) per second.

Also: `preprocess`, tokenising `bench.preprocess_rows` rows into a fresh cache and then loading them
from it; `tokenize`, the same `bench.tokenize_rows` multi-turn rows (about 300 tokens each) tokenised in
one process by `sft.data.labels.tokenize_batch` and by sft 0.1's (`sft.bench.baseline`), interleaved, one core
each, beside the tokenizer alone on the same texts (what no labelling can go below); `scale`, preprocessing
`bench.scale_rows` such rows into a fresh cache on every core (rows/s, the peak resident memory of the
process and of its largest worker), then loading them from the cache; `startup`, the wall time of `python -m
sft.train --cfg job`, `--help` and `--help loss loss=focal`, and of the default run from the command to its first
optimizer step (`startup_first_step_s`, warm caches).

`preset=gpu_7b` is the GPU check: LoRA on a randomly initialised model of Qwen2.5-7B's shape, bf16,
packed rows of about 4k tokens, the lean loss, 20 steps (see conf/preset/gpu_7b.yaml).

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

from sft.bench.cases import (CASE_OVERRIDES, EVAL_CASES, LOSS_CASES, RESULT, TRAINING_CASES, TRL_CASES, child,
                             timed_training_overrides)
from sft.bench.config import compose
from sft.config.schema import ConfigError
from sft.config.validate import check

TARGETS = {  # ratio: (target, "min" if it must be at least the target, "max" if at most)
    "ce_vs_hf": (0.97, "min"),
    "hard_sample_vs_hf": (0.97, "min"),
    "packing_vs_hf": (1.3, "min"),
    "ce_vs_trl": (1.05, "min"),
    "packing_vs_trl_padding_free": (1.3, "min"),
    "chunked_vs_naive_loss_memory": (0.3, "max"),
    "chunked_vs_naive_loss_time": (1.3, "max"),
    "preprocess_cached_speedup": (10.0, "min"),
    "tokenize_vs_baseline": (3.0, "min"),
    "scale_peak_rss_gb": (4.0, "max"),
    "scale_cached_load_s": (10.0, "max"),
    "startup_cfg_job_s": (1.0, "max"),
    "startup_help_s": (1.0, "max"),
    "startup_help_group_s": (1.0, "max"),
    "startup_first_step_s": (10.0, "max"),
}
# --- the driver --------------------------------------------------------------------------------------


def spawn(case: str, cfg, env: dict | None = None) -> dict:
    """Run one case in a fresh process; its result, or why it failed."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml(cfg))
    try:
        proc = subprocess.run([sys.executable, "-m", "sft.bench", "--case", case, "--config", f.name],
                              capture_output=True, text=True, timeout=cfg.bench.case_timeout_s,
                              env={**os.environ, **(env or {})})
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    raise RuntimeError(f"bench case {case} failed (exit {proc.returncode}):\n{tail}")


def synthetic_rows(path: Path, rows: int) -> None:
    """`rows` chats in the bundled data's format: distinct additions, so none is a duplicate."""
    from sft.sample_data import SYSTEM_PROMPT

    with open(path, "w") as f:
        for i in range(rows):
            a, b = 7919 * i % 100003, 104729 * i % 99991
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                             {"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
                                "difficulty_score": 1.0 + i % 4}) + "\n")


def multi_turn_rows(path: Path, rows: int, turns: int = 2) -> None:
    """`rows` chats of a system turn and `turns` additions worked column by column, about 300 tokens each (the
    tiny tokenizer's), written one by one (a million rows take no memory to make)."""
    from sft.sample_data import SYSTEM_PROMPT

    def worked(a: int, b: int) -> str:
        steps, carry, x, y = [], 0, a, b
        while x or y or carry:
            total = x % 10 + y % 10 + carry
            steps.append(f"{x % 10} + {y % 10}{' + 1' if carry else ''} = {total}, write {total % 10}"
                         + (", carry 1" if total >= 10 else ""))
            carry, x, y = total // 10, x // 10, y // 10
        return "; ".join(steps) + f". So {a} + {b} = {a + b}."

    with open(path, "w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            for turn in range(turns):
                a, b = 10 + (7919 * i + 31 * turn) % 9990, 10 + (104729 * i + 17 * turn) % 9990
                messages += [{"role": "user", "content": f"Add {a} and {b}, column by column."},
                             {"role": "assistant", "content": worked(a, b)}]
            f.write(json.dumps({"messages": messages, "difficulty_score": 1.0 + i % 4}) + "\n")


def startup_seconds(*args: str) -> float:
    """Wall time of `python -m sft.train args...`, the best of three."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sft.train", *args], capture_output=True, check=True)
        best = min(best, time.perf_counter() - started)
    return best


def first_step_seconds(repeats: int = 2) -> float:
    """Wall time of the default run (`python -m sft.train`, no overrides but these) trained for one step,
    with no evaluation or checkpoint: from the command to the first optimizer step, plus saving the tiny
    model. Caches are warmed by one untimed run; the best of `repeats`."""
    best = float("inf")
    one_step = ["trainer.max_steps=1", "trainer.eval_strategy=no", "trainer.save_strategy=no", "trainer.report_to=[]"]
    with tempfile.TemporaryDirectory(prefix="sft-bench-first-step-") as tmp:
        for n in range(repeats + 1):
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "sft.train", *one_step, f"hydra.run.dir={tmp}/{n}"],
                           capture_output=True, check=True)
            if n:  # the first run warms the caches (tiny model, tokenised data)
                best = min(best, time.perf_counter() - started)
    return best


def trl_missing() -> str | None:
    """Why the TRL cases cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[bench]')"
    return None


def case_id(case: str, batch_size: int, first: int) -> str:
    """A training case's name in the report: `ce` at the first of `bench.batch_sizes`, `ce_b16` at 16."""
    return case if batch_size == first else f"{case}_b{batch_size}"


def training_ratios(cases: dict, suffix: str) -> dict:
    """Throughput ratios (and peak-memory ratios against TRL) among the training cases of one batch size."""
    ratios = {}
    pairs = [("ce", "hf"), ("hard_sample", "hf"), ("packing", "hf"), ("ce", "trl"),
             ("packing", "trl_padding_free")]
    for ours, theirs in pairs:
        a, b = cases.get(ours + suffix), cases.get(theirs + suffix)
        if a and b:
            ratios[f"{ours}_vs_{theirs}{suffix}"] = a["tokens_per_second"] / b["tokens_per_second"]
            if theirs.startswith("trl"):
                ratios[f"{ours}_vs_{theirs}_memory{suffix}"] = a["peak_memory_gb"] / b["peak_memory_gb"]
    return ratios


def target_of(key: str):
    """The target of a ratio; one measured at another batch size (`_b16`) has its base ratio's."""
    base = key.rsplit("_b", 1)[0] if key.rsplit("_b", 1)[-1].isdigit() else key
    return TARGETS.get(base)


def run_all(overrides: list[str]) -> dict:
    """Every case of `bench.cases`, interleaved and repeated; the raw numbers, medians and ratios."""
    base = compose(overrides)
    check(base)  # the bench's node and the training config it runs, as python -m sft.train checks them
    b = base.bench
    report: dict = {"overrides": overrides, "raw": {}, "cases": {}, "ratios": {}, "skipped": {}}
    wanted = list(b.cases)
    if any(case in TRL_CASES for case in wanted) and (reason := trl_missing()):
        print(f"skipping {', '.join(c for c in wanted if c in TRL_CASES)}: {reason}", file=sys.stderr)
        report["skipped"].update({case: reason for case in wanted if case in TRL_CASES})
        wanted = [case for case in wanted if case not in TRL_CASES]
    jobs = {}  # case id -> (case, config)
    batch_sizes = list(b.batch_sizes or [base.trainer.per_device_train_batch_size])
    for size in batch_sizes:
        for case in wanted:
            if case in TRAINING_CASES:
                cfg = compose(overrides + CASE_OVERRIDES[case] + timed_training_overrides(base)
                              + [f"trainer.per_device_train_batch_size={size}"])
                jobs[case_id(case, size, batch_sizes[0])] = (case, cfg)
    evaluation = compose(overrides + ["loss=ce", "trainer.report_to=[]", "trainer.disable_tqdm=true"])
    jobs.update({case: (case, evaluation) for case in wanted if case in EVAL_CASES})
    jobs.update({case: (case, base) for case in wanted if case in LOSS_CASES})
    raw = report["raw"] = {name: [] for name in jobs}
    for round_ in range(b.repeats):
        for name, (case, cfg) in jobs.items():
            print(f"[round {round_ + 1}/{b.repeats}] {name} ...", file=sys.stderr, flush=True)
            raw[name].append(spawn(case, cfg))
    for name, runs in raw.items():
        report["cases"][name] = {key: statistics.median(run[key] for run in runs)
                                 for key in runs[0] if isinstance(runs[0][key], (int, float))}
    cases, ratios = report["cases"], report["ratios"]
    for size in batch_sizes:
        ratios.update(training_ratios(cases, case_id("", size, batch_sizes[0])))
    if all(case in cases for case in EVAL_CASES):
        ours, theirs = (cases[case]["seconds_per_1000_rows"] for case in ("eval_sft", "eval_hf"))
        ratios["eval_vs_hf_time"] = ours / theirs
    if all(case in cases for case in LOSS_CASES):
        naive, chunked = cases["loss_naive"], cases["loss_chunked"]
        ratios["chunked_vs_naive_loss_memory"] = chunked["peak_memory_gb"] / naive["peak_memory_gb"]
        ratios["chunked_vs_naive_loss_time"] = chunked["seconds"] / naive["seconds"]
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
    if "startup" in b.cases:
        ratios["startup_cfg_job_s"] = startup_seconds("--cfg", "job")
        ratios["startup_help_s"] = startup_seconds("--help")
        ratios["startup_help_group_s"] = startup_seconds("--help", "loss", "loss=focal")
        ratios["startup_first_step_s"] = first_step_seconds()
    report["targets"] = {}
    for key, value in ratios.items():
        if (target := target_of(key)) is not None:
            t, kind = target
            report["targets"][key] = {"target": t, "kind": kind, "met": value >= t if kind == "min" else value <= t}
    return report


def print_report(report: dict) -> None:
    cases = report["cases"]
    print(f"\n{'case':<22}{'tokens/s':>12}{'vs hf':>8}{'peak GiB':>10}{'vs hf':>8}{'mfu':>8}")
    for name, c in cases.items():
        if "tokens_per_second" not in c:
            continue
        suffix = name[len(name.rsplit("_b", 1)[0]):] if name.rsplit("_b", 1)[-1].isdigit() else ""
        hf = cases.get("hf" + suffix, {})
        print(f"{name:<22}{c['tokens_per_second']:>12.0f}"
              f"{c['tokens_per_second'] / hf['tokens_per_second'] if hf else float('nan'):>8.2f}"
              f"{c['peak_memory_gb']:>10.2f}"
              f"{c['peak_memory_gb'] / hf['peak_memory_gb'] if hf else float('nan'):>8.2f}"
              f"{c['mfu'] if 'mfu' in c else float('nan'):>8.3f}")
    for case in EVAL_CASES:
        if case in cases:
            c = cases[case]
            print(f"{case:<22}{c['seconds_per_1000_rows']:>10.2f} s per 1,000 eval rows ({c['rows']} rows)")
    for case in LOSS_CASES:
        if case in cases:
            c = cases[case]
            print(f"{case:<22}{c['tokens'] / c['seconds']:>12.0f}{'':>8}{c['peak_memory_gb']:>10.2f}   "
                  f"({c['seconds']:.2f} s forward+backward)")
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
    for case, reason in report.get("skipped", {}).items():
        print(f"{case:<22}skipped: {reason}")
    print()
    for key, value in report["ratios"].items():
        target = report["targets"].get(key)
        mark = "" if target is None else (f"  target {'>=' if target['kind'] == 'min' else '<='} {target['target']}: "
                                          f"{'met' if target['met'] else 'NOT MET'}")
        print(f"{key:<38}{value:>8.3f}{mark}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sft.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench.json", help="where to write the raw numbers and ratios")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.case:
        child(args.case, args.config)
        return 0
    try:
        report = run_all(overrides)
    except ConfigError as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
