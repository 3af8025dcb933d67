"""The GPU pack's run (`sft.bench.pack`): a part out of time gets SIGTERM (time to save), then SIGKILL with every
process it started; a stopped bench's finished cases and finished pairs stand; the check names each wrong version."""

import sys
import time
from pathlib import Path

import pytest
import torch


@pytest.mark.slow  # a bench in a process of its own, waited out
def test_a_part_out_of_time_gets_sigterm_then_sigkill_with_every_process_it_started(tmp_path):
    """The bench runs each case in a process of its own: when the pack's time limit ends the bench, its case dies too,
    and holds no GPU memory into the tests that follow; the bench is told first (SIGTERM), so that it stops its case
    and keeps what it finished."""
    from sft.bench.pack import run_part

    pid_file, told = tmp_path / "child.pid", tmp_path / "told"
    script = ("import signal, subprocess, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *a: open({str(told)!r}, 'w').write('term'))\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "while True: time.sleep(0.1)\n")  # ignores the SIGTERM (past saving): SIGKILL follows
    part = run_part([sys.executable, "-c", script], 3, tmp_path / "part.log", grace_s=1)
    assert part["exit_code"] == 124 and part["seconds"] < 30
    assert told.read_text() == "term"
    child = int(pid_file.read_text())

    def dead() -> bool:  # gone, or a zombie (dead, only not yet reaped)
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except (FileNotFoundError, ProcessLookupError):
            return True

    deadline = time.monotonic() + 10  # SIGKILL is delivered when the process is next scheduled: not at once
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead(), f"the part's own child {child} is still running"


def test_a_bench_stopped_by_its_time_limit_keeps_its_cases_and_the_ratios_of_the_pairs_that_finished(tmp_path,
                                                                                                    monkeypatch):
    """While the bench runs, the cases finished so far stand on disk (written whole after each): a limit that kills
    it during the third case leaves the first two's figures and their ratio for the pack, which says it stopped."""
    import sft.bench.run
    from sft.bench.figures import figures_markdown
    from sft.bench.pack import bench_report

    out = tmp_path / "bench.json"
    partial = out.with_name("bench.json.partial")
    seen = []

    def spawn(case, cfg, env=None, processes=1):
        seen.append(bench_report(out))  # what the pack would read if the bench were killed now
        return {"tokens_per_second": 1000.0 * len(seen), "peak_memory_gb": 2.0, "mfu": 0.25, "mfu_6n": 0.2,
                "losses": [1.0]}

    monkeypatch.setattr(sft.bench.run, "spawn", spawn)
    report = sft.bench.run.run_all(["bench.cases=[packing,ce,trl_best]", "bench.repeats=1", "bench.batch_sizes=null"],
                                   partial)
    assert seen[0] is None  # nothing finished, nothing claimed
    assert list(seen[1]["cases"]) == ["packing"] and seen[1]["ratios"] == {"mfu_packing": 0.25, "mfu_6n_packing": 0.2}
    stopped = seen[2]
    assert stopped["partial"] and list(stopped["cases"]) == ["packing", "ce"]
    assert stopped["ratios"]["packing_gain"] == 0.5 and "packing_vs_trl_best" not in stopped["ratios"]
    assert stopped["targets"]["packing_gain"] == {"target": 1.3, "kind": "min", "met": False}
    assert report["ratios"]["packing_vs_trl_best"] == 1000.0 / 3000.0  # the whole run: every pair
    figures = figures_markdown({"machine": {"date": "2026-12-06", "gpu": "NVIDIA H100 80GB HBM3", "gpus": 1,
                                            "memory_gib": 79.2, "cuda": "12.8", "versions": {"torch": "2.13.0",
                                                                                         "transformers": "5.24.0"}},
                                "parts": {"bench": {"exit_code": 124, "seconds": 330.2}, "tests": {"exit_code": 0}},
                                "tests": [], "bench": stopped})
    assert ("| (stopped) | the bench ran out of its 330 s: the cases it finished, and the ratios of the pairs that "
            "both finished |") in figures
    assert "| packing | 1,000 tokens/s, MFU 0.250 (6N: 0.200), peak 2.0 GiB |" in figures
    assert "| packing_gain | 0.500 (target >= 1.3: not met) |" in figures


def test_the_check_names_every_requirement_and_each_version_the_pins_do_not_take(monkeypatch):
    # On a fresh GPU image the pack met missing installs one at a time (issue 32), and wrong versions not at all
    # (issue 69: transformers 5.17 beside a pin of 5.24): --check names them all at once.
    import importlib.util

    from sft.bench.pack import REQUIREMENTS, check_machine

    lines, ready = check_machine({"transformers": "==5.17.0", "no-such-distribution": ">=1"})
    text = "\n".join(lines)
    assert all(f" {dist} " in text for _, dist, _, _ in REQUIREMENTS) and " CUDA GPU " in text
    import transformers

    assert f"  WRONG    transformers: {transformers.__version__} installed, wanted ==5.17.0" in lines
    assert "  WRONG    no-such-distribution: not installed (wanted >=1)" in lines and not ready
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "antlr4" else find_spec(name, *a))
    lines, ready = check_machine({})
    assert not ready
    assert any(line.startswith("  MISSING  antlr4-python3-runtime") and "antlr4-python3-runtime==4.9.3" in line
               for line in lines)
    assert lines[-1].startswith("  ok       CUDA GPU" if torch.cuda.is_available() else "  MISSING  CUDA GPU")
