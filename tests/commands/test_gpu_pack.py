"""The GPU pack on a machine without one: it refuses in one line, every gpu test skips with the reason, and
the figures it writes from pytest's own JUnit report say what happened to each test."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


@needs_cpu_only
def test_the_pack_refuses_in_one_line_without_a_gpu_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sft", "gpu-pack", "--out", str(tmp_path / "pack")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu pack: no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: none): nothing to run "
        "(the gpu tests skip without one)"]
    assert not (tmp_path / "pack").exists()


@pytest.mark.slow
@needs_cpu_only
def test_every_gpu_test_is_collected_and_skipped_without_cuda(tmp_path):
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    from sft.commands.gpu_pack import test_outcomes

    outcomes = test_outcomes(junit)
    import ast

    module = ast.parse((REPO / "tests" / "e2e" / "test_gpu.py").read_text())
    defined = {node.name for node in module.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    # all of them (a parametrized one once a parameter), and nothing else carries the marker
    assert {o["test"].split("[")[0] for o in outcomes} == defined
    assert {(o["outcome"], o["detail"]) for o in outcomes} == {("skipped", "needs a CUDA GPU")}


def test_figures_say_what_each_test_did_and_replace_only_the_readme_block(tmp_path):
    """From a JUnit report pytest itself wrote (a pass, a failure, a skip) and a bench report, the figures name
    each outcome, the bench's throughput and targets; the README keeps everything outside its markers."""
    from sft.commands.gpu_pack import (FIGURES_BEGIN, FIGURES_END, figures_markdown, put_between_markers, readme_summary,
                                       test_outcomes)

    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'the gradients differ'\n"
        "def test_absent():\n    pytest.skip('liger-kernel is not installed')\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_three.py"), "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}", "--rootdir", str(tmp_path)], cwd=tmp_path, capture_output=True, timeout=120)
    tests = test_outcomes(junit)
    assert [(t["test"], t["outcome"]) for t in tests] == [("test_ok", "passed"), ("test_bad", "failed"),
                                                          ("test_absent", "skipped")]
    assert "the gradients differ" in tests[1]["detail"] and tests[2]["detail"] == "liger-kernel is not installed"
    report = {"machine": {"date": "2026-12-01", "gpu": "NVIDIA H200", "gpus": 1, "memory_gib": 139.8, "cuda": "12.8",
                          "versions": {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2",
                                       "cut-cross-entropy": "25.1.1", "liger-kernel": None, "flash-attn": "2.8.3",
                                       "bitsandbytes": "0.50.2"}},
              "parts": {"tests": {"exit_code": 1}, "bench": {"exit_code": 0}}, "tests": tests,
              "bench": {"cases": {"packing": {"tokens_per_second": 12345.6, "peak_memory_gb": 31.25, "mfu": 0.412,
                                              "mfu_6n": 0.301},
                                  "trl_best": {"tokens_per_second": 9000.0, "peak_memory_gb": 40.0},
                                  "loss_cce": {"seconds": 0.0851, "tokens": 8192, "peak_memory_gb": 0.114,
                                               "loss_error": 3.01e-6, "grad_error": 0.0121}},
                        "raw": {"loss_cce": [{"impl": "cce"}]},
                        "ratios": {"chunked_vs_naive_loss_memory": 0.21},
                        "targets": {"chunked_vs_naive_loss_memory": {"target": 0.3, "kind": "max", "met": True}}}}
    figures = figures_markdown(report)
    assert "Measured 2026-12-01 on 1 x NVIDIA H200 (139.8 GiB)" in figures and "liger-kernel not installed" in figures
    assert "| `test_bad` | failed: " in figures and "| `test_absent` | skipped: liger-kernel is not installed |" in figures
    assert "| packing | 12,346 tokens/s, MFU 0.412 (6N: 0.301), peak 31.2 GiB |" in figures
    assert "| trl_best | 9,000 tokens/s, MFU unknown (GPU not in the table), peak 40.0 GiB |" in figures
    assert "stopped" not in figures
    assert "| chunked_vs_naive_loss_memory | 0.210 (target <= 0.3: met) |" in figures
    assert ("| loss_cce (cce) | 85 ms forward+backward of 8,192 tokens, peak 0.11 GiB; from fp32: losses 3.0e-06, "
            "hidden-state gradient 1.2e-02 |") in figures

    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n\n{FIGURES_BEGIN}\nnot measured yet\n{FIGURES_END}\n\n## after\n")
    assert put_between_markers(readme, figures)
    text = readme.read_text()
    assert text.startswith("# top\n\n" + FIGURES_BEGIN + "\nMeasured 2026-12-01") and text.endswith(FIGURES_END + "\n\n## after\n")
    assert "not measured yet" not in text
    assert not put_between_markers(tmp_path / "test_three.py", figures)  # no markers: left alone
    report["bench"]["cases"]["packing"]["tokens_per_second"] = 6368.2
    report["bench"]["raw"]["loss_lean"] = [{"impl": "liger"}]
    report["bench"]["ratios"].update(lean_vs_naive_loss_time=0.903, lean_vs_naive_loss_memory=0.0227,
                                     packing_vs_trl_best=1.372)
    assert readme_summary(report) == (
        "Measured 2026-12-01 on 1 x NVIDIA H200 (`sft gpu-pack`): GPU tests 1 passed, 1 failed, 1 skipped. LoRA on "
        "Qwen2.5-7B's shape (bf16, packed 4k-token rows): 6,368 tokens/s, MFU 0.412, peak 31.2 GiB. The LoRA 7B's "
        "tokens/s: 1.37x TRL's SFTTrainer at their fastest settings, same rows. The loss "
        "`loss.impl=auto` picks (liger) at its output layer: 0.90x the naive loss's time in 0.023x its memory. Every "
        "figure: [Performance](docs/performance.md#gpu-figures).\n")


def test_a_bench_stopped_by_its_time_limit_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """While the bench runs, the cases finished so far stand on disk (written whole after each): a time limit that
    kills it during the second case leaves the first one's figures for the pack, which says it stopped."""
    import sft.bench.run
    from sft.commands.gpu_pack import bench_report, figures_markdown

    out = tmp_path / "bench.json"
    partial = out.with_name("bench.json.partial")
    seen = []

    def spawn(case, cfg, env=None, processes=1):
        seen.append(bench_report(out))  # what the pack would read if the bench were killed now
        return {"tokens_per_second": 1000.0 * len(seen), "peak_memory_gb": 2.0, "mfu": 0.25, "mfu_6n": 0.2,
                "losses": [1.0]}

    monkeypatch.setattr(sft.bench.run, "spawn", spawn)
    report = sft.bench.run.run_all(["bench.cases=[packing,ce]", "bench.repeats=1", "bench.batch_sizes=null"], partial)
    assert seen[0] is None  # nothing finished, nothing claimed
    stopped = seen[1]
    assert stopped["partial"] and list(stopped["cases"]) == ["packing"] and stopped["ratios"] == {}
    assert stopped["cases"]["packing"]["tokens_per_second"] == 1000.0
    assert report["cases"]["ce"]["tokens_per_second"] == 2000.0 and report["ratios"]["packing_gain"] == 0.5
    figures = figures_markdown({"machine": {"date": "2026-12-06", "gpu": "NVIDIA H100 80GB HBM3", "gpus": 1,
                                            "memory_gib": 79.2, "cuda": "12.8", "versions": {"torch": "2.13.0",
                                                                                         "transformers": "5.24.0"}},
                                "parts": {"bench": {"exit_code": 124, "seconds": 330.2}, "tests": {"exit_code": 0}},
                                "tests": [], "bench": stopped})
    assert "| (stopped) | the bench ran out of its 330 s: the cases it finished, no ratios |" in figures
    assert "| packing | 1,000 tokens/s, MFU 0.250 (6N: 0.200), peak 2.0 GiB |" in figures


def test_a_part_out_of_time_is_killed_with_every_process_it_started(tmp_path):
    """The bench runs each case in a process of its own: when the pack's time limit ends the bench, its case dies
    too, and holds no GPU memory into the tests that follow."""
    import time
    from pathlib import Path

    from sft.commands.gpu_pack import run_part

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(60)\n")
    part = run_part([sys.executable, "-c", script], 3, tmp_path / "part.log")
    assert part["exit_code"] == 124 and part["seconds"] < 30
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


def test_check_lists_what_the_pack_needs_and_how_to_install_it_without_running_anything(monkeypatch):
    # On a fresh GPU image the pack met missing installs one at a time (issue 32): --check names them all at once.
    proc = subprocess.run([sys.executable, "-m", "sft", "gpu-pack", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from sft.commands.gpu_pack import REQUIREMENTS, check_machine

    out = proc.stdout
    assert all(f" {distribution} " in out for _, distribution, _, _ in REQUIREMENTS) and " CUDA GPU " in out
    assert out.strip().endswith("ready: yes" if torch.cuda.is_available() else "ready: no")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "antlr4" else find_spec(name, *a))
    lines, ready = check_machine()
    assert not ready
    assert any(line.startswith("  MISSING  antlr4-python3-runtime") and "pip install antlr4-python3-runtime==4.9.3" in line
               for line in lines)


def test_the_pack_finds_the_gpu_tests_and_the_docs_it_writes_into():
    """The pack's parts run in the checkout: its GPU tests, and the README and performance page whose markers
    receive the figures (a move of the module once pointed all three at sft/, and the pack ran no test)."""
    from sft.commands.gpu_pack import FIGURES_BEGIN, FIGURES_END, GPU_TESTS, PERFORMANCE_DOC
    from sft.commands.gpu_pack import REPO as PACK_REPO

    assert PACK_REPO == REPO and GPU_TESTS.is_file()
    for doc in (PACK_REPO / "README.md", PERFORMANCE_DOC):
        text = doc.read_text()
        assert text.count(FIGURES_BEGIN) == text.count(FIGURES_END) == 1, doc
