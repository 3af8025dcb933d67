"""The bench's figures put together and printed: each training case's hardware ratios against the machine's own
matrix-product rate (`hardware_ratios`), the table of every case (`print_report`), and the results so far of a run
still going (`write_partial`), read back as a report where a time limit stopped it (`read_partial`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sft.bench.cases import CASES, MATMUL, TRAINING, Case, target_of
from sft.bench.profile import CATEGORIES


def case_id(case: str, batch_size: int, first: int) -> str:
    """A training case's name in the report: `ce` at the first of `bench.batch_sizes`, `ce_b16` at 16."""
    return case if batch_size == first else f"{case}_b{batch_size}"


def paired(rounds: list[dict], ours: str, theirs: str, key: str = "tokens_per_second") -> list[float]:
    """`ours[key] / theirs[key]` in each round where both ran: the ratio of two cases measured side by side."""
    return [r[ours][key] / r[theirs][key] for r in rounds if ours in r and theirs in r]


def pair_ratios(case: Case, rounds: list[dict], suffixes: list[str]) -> dict[str, list[float]]:
    """Each ratio `case` feeds against another case, per round (a training case's at each batch size: `suffixes`);
    `<name>_memory` beside those that ask for it."""
    ratios = {}
    for suffix in suffixes if case.kind == TRAINING else [""]:
        ours = case.name + suffix
        for name, ratio in case.ratios.items():
            if ratio.versus is None or ours not in (rounds[0] if rounds else {}):
                continue
            if ratio.when is not None and not ratio.when(rounds[0][ours]):
                continue
            if values := paired(rounds, ours, ratio.versus + suffix, ratio.key):
                ratios[name + suffix] = values
                if ratio.memory:
                    ratios[f"{name}_memory{suffix}"] = paired(rounds, ours, ratio.versus + suffix, "peak_memory_gb")
    return ratios


def round_figures(report: dict, rounds: list[dict], names: list[str], suffixes: list[str]) -> None:
    """Into `report`: each case's runs (`raw`) and medians (`cases`) over the rounds, and the ratios of the cases
    `names` as medians of their per-round values with their spread (`ratios`, `spread`): the pairs that both ran, the
    hardware ratios, MFU where the GPU's peak is known, the profiled breakdowns. What a stopped run finished gives
    the ratios of the pairs it finished (`read_partial`)."""
    cases = report["cases"]
    for name in dict.fromkeys(name for r in rounds for name in r):
        runs = [r[name] for r in rounds if name in r]
        report["raw"][name] = runs
        cases[name] = {key: statistics.median(run[key] for run in runs)
                       for key in runs[0] if isinstance(runs[0][key], (int, float))}
    wanted = [CASES[name] for name in names if name in CASES]
    per_round = {}
    for case in wanted:
        per_round.update(pair_ratios(case, rounds, suffixes))
    per_round.update(hardware_ratios(rounds, cases, [case.name for case in wanted if case.kind == MATMUL]))
    for case in wanted:  # MFU, where the GPU's peak is known (the table's, or throughput.peak_tflops)
        if f"mfu_{case.name}" in case.ratios and "mfu" in cases.get(case.name, {}):
            per_round[f"mfu_{case.name}"] = [r[case.name]["mfu"] for r in rounds if case.name in r]
            per_round[f"mfu_6n_{case.name}"] = [r[case.name]["mfu_6n"] for r in rounds if case.name in r]
    breakdowns(rounds, cases)
    for key, values in per_round.items():
        report["ratios"][key] = statistics.median(values)
        report["spread"][key] = [min(values), max(values)]


def judge_targets(report: dict) -> None:
    """Each ratio that has a target, met or not, into `report["targets"]`."""
    report["targets"] = {}
    for key, value in report["ratios"].items():
        if (target := target_of(key)) is not None:
            t, kind = target
            report["targets"][key] = {"target": t, "kind": kind, "met": value >= t if kind == "min" else value <= t}


def hardware_ratios(rounds: list[dict], cases: dict, matmul: list[str]) -> dict[str, list[float]]:
    """Per round, each training case's executed and model FLOP/s over the limit of its dtype: the best reading of
    the matmul case (of those named `matmul`) in that dtype over the whole run (one round's reading moves with the machine: its spread goes
    into `cases[<matmul case>]`). `hw_exec_<case>` and `hw_model_<case>`, their medians in `cases[<case>]`.

        rounds = [{"ce": {"exec_gflops": 20, "model_gflops": 25, "dtype": "float32"}, "matmul": {"gflops": 40, ...}},
                  {"ce": {...}, "matmul": {"gflops": 50, ...}}]   -> hw_exec_ce: [20 / 50, ...] (the best: 50)
    """
    best = {}
    for name in matmul:
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
    shown = [name for name in cases if name in CASES and CASES[name].show is not None]
    for name in (name for name in shown if CASES[name].kind == MATMUL):
        print("\n".join(CASES[name].show(name, report)))
    if any(CASES[name].kind == MATMUL for name in shown):
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
    for name in (name for name in shown if CASES[name].kind != MATMUL):
        print("\n".join(CASES[name].show(name, report)))
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
    """The results so far (`rounds`: each round's cases that have run) and what their ratios need (the cases asked for,
    the batch sizes' suffixes); written whole, then renamed over the last one (a reader never sees half a file)."""
    partial = {"overrides": report["overrides"], "partial": True, "rounds": rounds, "failed": report["failed"],
               "skipped": report["skipped"], "names": report.get("names", []), "suffixes": report.get("suffixes", [""])}
    path.with_name(path.name + ".tmp").write_text(json.dumps(partial, indent=2) + "\n")
    path.with_name(path.name + ".tmp").replace(path)


def read_partial(path: Path) -> dict:
    """A report of the cases a stopped run finished (`write_partial`'s file): each case's median figures and the
    ratios of the pairs that both finished in a round, with their targets; `partial: true`."""
    saved = json.loads(path.read_text())
    report = {key: saved[key] for key in ("overrides", "partial", "failed", "skipped")}
    report.update(raw={}, cases={}, ratios={}, spread={}, rounds=[])
    rounds = [{name: result for name, result in r.items() if name not in saved["failed"]} for r in saved["rounds"]]
    round_figures(report, rounds, saved["names"], saved["suffixes"])
    judge_targets(report)
    return report
