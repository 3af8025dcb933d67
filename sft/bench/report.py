"""The bench's figures put together and printed: each training case's hardware ratios against the machine's own
matrix-product rate (`hardware_ratios`), the table of every case (`print_report`), and the results so far of a run
still going (`write_partial`), read back as a report where a time limit stopped it (`read_partial`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sft.bench.cases import EVAL_CASES
from sft.bench.loss_cases import LOSS_CASES, LOSS_KERNEL_CASES
from sft.bench.matmul import MATMUL_CASES
from sft.bench.profile import CATEGORIES


def hardware_ratios(rounds: list[dict], cases: dict) -> dict[str, list[float]]:
    """Per round, each training case's executed and model FLOP/s over the limit of its dtype: the best reading of
    the matmul case in that dtype over the whole run (one round's reading moves with the machine: its spread goes
    into `cases[<matmul case>]`). `hw_exec_<case>` and `hw_model_<case>`, their medians in `cases[<case>]`.

        rounds = [{"ce": {"exec_gflops": 20, "model_gflops": 25, "dtype": "float32"}, "matmul": {"gflops": 40, ...}},
                  {"ce": {...}, "matmul": {"gflops": 50, ...}}]   -> hw_exec_ce: [20 / 50, ...] (the best: 50)
    """
    best = {}
    for name in MATMUL_CASES:
        readings = [r[name]["gflops"] for r in rounds if name in r]
        if readings:
            best[rounds[0][name]["dtype"]] = max(readings)
            cases[name].update(gflops_best=max(readings), gflops_spread=[min(readings), max(readings)],
                               dtype=rounds[0][name]["dtype"])
    ratios = {}
    for name in cases:
        runs = [r[name] for r in rounds if "exec_gflops" in r.get(name, {})]
        if not runs or runs[0]["dtype"] not in best:
            continue
        limit = best[runs[0]["dtype"]]
        for kind in ("exec", "model"):
            ratios[f"hw_{kind}_{name}"] = values = [run[f"{kind}_gflops"] / limit for run in runs]
            cases[name][f"hw_{kind}"] = statistics.median(values)
    return ratios


def breakdowns(rounds: list[dict], cases: dict) -> None:
    """Each profiled case's breakdown (`sft.bench.profile`), the median of each category's share over the rounds,
    into `cases[<case>]["breakdown"]`."""
    for name in cases:
        runs = [r[name]["breakdown"] for r in rounds if "breakdown" in r.get(name, {})]
        if runs:
            cases[name]["breakdown"] = {key: statistics.median(run[key] for run in runs) for key in CATEGORIES}


def print_report(report: dict) -> None:
    cases = report["cases"]
    gpu = any("cpu_share" not in c for c in cases.values() if "tokens_per_second" in c)
    memory = "peak GiB" if gpu else "peak RSS"
    print(f"\n{'case':<26}{'tokens/s':>12}{'vs hf':>8}{memory:>10}{'vs hf':>8}{'cpu s':>8}{'mfu':>8}{'GFLOP/s':>9}"
          f"{'hw exec':>8}{'hw 6N':>8}")
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
              f"{c.get('exec_gflops', float('nan')):>9.1f}{c.get('hw_exec', float('nan')):>8.3f}"
              f"{c.get('hw_model', float('nan')):>8.3f}")
    for name in MATMUL_CASES:
        if name in cases:
            m = cases[name]
            print(f"{name}: torch.mm over the model's products in {m['dtype']} ({m['tokens']:.0f} rows each): best "
                  f"{m['gflops_best']:.1f} GFLOP/s, rounds {m['gflops_spread'][0]:.1f}-{m['gflops_spread'][1]:.1f}")
    if any(name in cases for name in MATMUL_CASES):
        print("hw exec: the FLOP/s of the products a case's step executes (GFLOP/s; the output layer at the positions "
              "whose logits are computed) over the best matmul rate in its dtype; hw 6N: the MFU convention's 6N FLOPs "
              "per token plus attention over the same rate (sft.training.observability.throughput)")
    if not gpu and any("tokens_per_second" in c for c in cases.values()):
        print("(memory on a CPU: each case's whole-process peak resident memory, imports and data included)"
              if report.get("isolated", True) else "(bench.isolate=false: the cases shared one process, so memory "
              "figures are that process's peak so far, not each case's own)")
    profiled = {name: c["breakdown"] for name, c in cases.items() if "breakdown" in c}
    if profiled:
        print("\nwhere a step's time goes (shares of the profiled steps' wall time, sft.bench.profile):")
        print(f"{'case':<26}" + "".join(f"{key:>12}" for key in CATEGORIES))
        for name, shares in profiled.items():
            print(f"{name:<26}" + "".join(f"{shares[key]:>12.3f}" for key in CATEGORIES))
    for case in EVAL_CASES:
        if case in cases:
            c = cases[case]
            print(f"{case:<22}{c['seconds_per_1000_rows']:>10.2f} s per 1,000 eval rows ({c['rows']} rows)")
    for case in (*LOSS_CASES, *LOSS_KERNEL_CASES):
        if case in cases:
            c = cases[case]
            impl = report["raw"][case][0]["impl"]
            errors = (f"; from fp32: losses {c['loss_error']:.2g}, gradient {c['grad_error']:.2g}"
                      if "grad_error" in c else "")
            print(f"{case:<22}{c['tokens'] / c['seconds']:>12.0f}{'':>8}{c['peak_memory_gb']:>10.2f}   "
                  f"({c['seconds']:.3f} s forward+backward, {impl}; first call {c['first_seconds']:.2f} s{errors})")
    if "preprocess" in cases:
        p = cases["preprocess"]
        print(f"preprocess    {p['rows']} rows: first {p['first_s']:.1f} s, cached {p['cached_s']:.2f} s")
    if "tokenize" in cases:
        t = cases["tokenize"]
        print(f"tokenize      {t['rows']} multi-turn rows, rows/s on one core: sft {t['sft_rows_per_second']:.0f} "
              f"({t['sft_renders_per_row']:g} renders a row), the tokenizer's apply_chat_template(tokenize=True) "
              f"{t['chat_rows_per_second']:.0f} (1 render, no labels), encoding the rendered texts alone "
              f"{t['tokenizer_rows_per_second']:.0f}, sft 0.1 {t['baseline_rows_per_second']:.0f} "
              f"({t['baseline_renders_per_row']:g} renders)")
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
    if "stream" in cases:
        print("stream        " + "; ".join(
            f"{r['sequences']:,} sequences of a {int(n):,}-row file in {r['seconds']:.0f} s, peak RSS "
            f"{r['peak_rss_gb']:.2f} GiB" for n, r in cases["stream"].items()))
    if "checkpoint_memory" in cases:
        c = cases["checkpoint_memory"]
        print(f"checkpoint    full fine-tune, 2 processes (FSDP2), a {c['checkpoint_mib']:.0f} MiB checkpoint ("
              f"{c['share_mib']:.0f} MiB a rank): memory above the step's while saving: " + "; ".join(
                  f"{fmt} " + ", ".join(f"rank {r} +{m:.0f} MiB" for r, m in enumerate(c[fmt]["rank_mib"]))
                  + f" ({c[fmt]['seconds']:.1f} s)" for fmt in ("gathered", "sharded")))
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
    for case, error in report.get("failed", {}).items():
        print(f"{case:<22}failed: {error.splitlines()[-1]}")
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


def write_partial(path: Path, report: dict, rounds: list[dict]) -> None:
    """The results so far (`rounds`: each round's cases that have run), in the form of the report's `raw`; written
    whole, then renamed over the last one (a reader never sees half a file)."""
    raw: dict = {}
    for results in rounds:
        for name, result in results.items():
            raw.setdefault(name, []).append(result)
    partial = {"overrides": report["overrides"], "partial": True, "raw": raw, "failed": report["failed"],
               "skipped": report["skipped"]}
    path.with_name(path.name + ".tmp").write_text(json.dumps(partial, indent=2) + "\n")
    path.with_name(path.name + ".tmp").replace(path)


def read_partial(path: Path) -> dict:
    """A report of the cases a stopped run finished (`write_partial`'s file): each case's median figures, no ratios
    (a ratio's cases may not both have run), `partial: true`."""
    report = json.loads(path.read_text())
    report["cases"] = {name: {key: statistics.median(run[key] for run in runs)
                              for key in runs[0] if isinstance(runs[0][key], (int, float))}
                       for name, runs in report["raw"].items()}
    report.update(ratios={}, spread={}, targets={})
    return report
