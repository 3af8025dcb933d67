"""`sft gpu-pack`: without a GPU it refuses in one line; the very same pack rehearsed on the CPU lands its figures
within its limits (a case stopped by its own limit and a test by its own, everything finished kept, offline); every
GPU test is collected and skips with the reason; the figures go into the docs from the returned report."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")


@pytest.mark.slow
@needs_cpu_only
def test_the_pack_refuses_in_one_line_without_a_gpu_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sft", "gpu-pack", "--out", str(tmp_path / "pack")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu pack: no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: none): nothing to run "
        "(the gpu tests skip without one; --cpu rehearses the pack)"]
    assert not (tmp_path / "pack").exists()


@pytest.mark.slow
def test_the_check_runs_nothing_and_says_whether_the_pack_would_run(tmp_path):
    pins = tmp_path / "pins.txt"
    pins.write_text("transformers==5.17.0\n# optional: liger-kernel>=0.8.2\n")
    proc = subprocess.run([sys.executable, "-m", "sft", "gpu-pack", "--check", "--pins", str(pins)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import transformers

    assert f"  WRONG    transformers: {transformers.__version__} installed, wanted ==5.17.0" in proc.stdout
    assert proc.stdout.strip().endswith("ready: no") and "liger-kernel: not installed" not in proc.stdout


REHEARSAL_TESTS = ("import os, time, pytest\n"
                   "@pytest.mark.gpu\n"
                   "def test_offline():\n    assert os.environ['HF_HUB_OFFLINE'] == '1'\n"
                   "@pytest.mark.gpu\n"
                   "def test_hangs():\n    time.sleep(60)\n"
                   "@pytest.mark.gpu\n"
                   "def test_after():\n    assert True\n")


@pytest.mark.slow  # the pack end to end on the tiny model: three bench cases and three tests (about 60 s)
def test_the_pack_rehearsed_on_the_cpu_lands_its_figures_with_a_case_and_a_test_stopped_by_their_limits(tmp_path):
    """`--cpu` runs the very pack a GPU machine runs, its budget scaled: the overrides after `--` reach the bench, a
    case past its own limit (1 s) is stopped and said, the others' figures and ratio stand, each case's log is
    written; a test past its limit fails and the next one runs; the parts run offline; the machine's packages are
    written; the docs are left alone."""
    tests = tmp_path / "test_rehearsal.py"
    tests.write_text(REHEARSAL_TESTS)
    out = tmp_path / "pack"
    before = (REPO / "docs" / "performance.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "sft", "gpu-pack", "--cpu", "--preset", "none", "--out", str(out), "--bench-timeout",
         "400", "--tests-timeout", "120", "--test-limit", "3", "--tests", str(tests), "--",
         "bench.cases=[packing,ce,packing_spread]", "bench.steps=4", "bench.warmup_steps=1", "bench.repeats=1",
         "bench.batch_sizes=[8]", "bench.min_cpu_share=0", "+bench.case_timeouts.packing_spread=1"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]  # a test failed: its own limit
    report = json.loads((out / "gpu_pack.json").read_text())
    bench = report["bench"]
    assert set(bench["cases"]) == {"packing", "ce"} and bench["ratios"]["packing_gain"] > 0
    assert "ran out of its 1 s (stopped with SIGTERM, then SIGKILL)" in bench["failed"]["packing_spread"]
    assert {p.name for p in (out / "cases").iterdir()} == {"packing-1.log", "ce-1.log", "packing_spread-1.log"}
    assert [(t["test"], t["outcome"]) for t in report["tests"]] == [("test_offline", "passed"),
                                                                   ("test_hangs", "failed"), ("test_after", "passed")]
    assert "over its limit of 3 s" in report["tests"][1]["detail"]
    assert report["parts"]["bench"]["exit_code"] == 0 and report["overrides"][0] == "bench.cases=[packing,ce,packing_spread]"
    assert "torch==" in (out / "image.txt").read_text()
    assert "| packing | " in (out / "figures.md").read_text()
    assert (REPO / "docs" / "performance.md").read_text() == before


@pytest.mark.slow
@needs_cpu_only
def test_every_gpu_test_is_collected_and_skipped_without_cuda(tmp_path):
    from sft.bench.outcomes import read

    outcomes = tmp_path / "outcomes.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/", "-q", "-p", "no:cacheprovider",
                           "-p", "sft.bench.outcomes"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SFT_TEST_OUTCOMES": str(outcomes)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    import ast

    module = ast.parse((REPO / "tests" / "e2e" / "test_gpu.py").read_text())
    defined = {node.name for node in module.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    # all of them (a parametrized one once a parameter), and nothing else carries the marker
    assert {o["test"].split("[")[0].split("::")[-1] for o in read(outcomes)} == defined
    assert {(o["outcome"], o["detail"]) for o in read(outcomes)} == {("skipped", "needs a CUDA GPU")}


def test_the_returned_figures_go_into_the_docs_between_their_markers(tmp_path):
    """`--apply gpu_pack.json` here: the figures into docs/performance.md's gpu-pack block, the summary into the
    README's; the pack finds its tests and the docs it writes into in the checkout (a move of the module once pointed
    all three at sft/, and the pack ran no test)."""
    from sft.bench.figures import FIGURES_BEGIN, FIGURES_END, apply
    from sft.commands.gpu_pack import GPU_TESTS, PERFORMANCE_DOC
    from sft.commands.gpu_pack import REPO as PACK_REPO

    assert PACK_REPO == REPO and GPU_TESTS.is_file()
    for doc in (PACK_REPO / "README.md", PERFORMANCE_DOC):
        text = doc.read_text()
        assert text.count(FIGURES_BEGIN) == text.count(FIGURES_END) == 1, doc
    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/performance.md"):
        (tmp_path / name).write_text(f"before\n{FIGURES_BEGIN}\nold\n{FIGURES_END}\nafter\n")
    report = {"machine": {"date": "2026-12-07", "gpu": "NVIDIA H200", "gpus": 1, "memory_gib": 139.8, "cuda": "13.0",
                          "versions": {"torch": "2.11.0", "transformers": "5.24.0"}},
              "parts": {"bench": {"exit_code": 0}, "tests": {"exit_code": 0}},
              "tests": [{"test": "test_a", "outcome": "passed", "detail": ""}],
              "bench": {"cases": {"packing": {"tokens_per_second": 5000.0, "peak_memory_gb": 30.0}}, "raw": {},
                        "ratios": {}, "targets": {}}}
    assert apply(report, tmp_path) == ["docs/performance.md", "README.md"]
    assert "| packing | 5,000 tokens/s" in (tmp_path / "docs/performance.md").read_text()
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("before\n") and readme.endswith("after\n") and "old" not in readme
    assert "GPU tests 1 passed, 0 failed, 0 skipped" in readme
