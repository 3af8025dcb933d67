"""The GPU pack's figures in words (`sft.bench.figures`): every test's outcome, the bench's cases and ratios with
their targets, the README's summary, each between its markers and nothing else touched."""

import os
import subprocess
import sys

from conftest import REPO


def test_figures_say_what_each_test_did_and_replace_only_the_readme_block(tmp_path):
    """From the outcomes pytest itself reported (a pass, a failure, a skip) and a bench report, the figures name
    each outcome, the bench's throughput and targets; the README keeps everything outside its markers."""
    from sft.bench.figures import FIGURES_BEGIN, FIGURES_END, figures_markdown, put_between_markers, readme_summary
    from sft.bench.outcomes import read

    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'the gradients differ'\n"
        "def test_absent():\n    pytest.skip('liger-kernel is not installed')\n")
    outcomes = tmp_path / "outcomes.jsonl"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_three.py"), "-q", "-p", "no:cacheprovider",
                    "-p", "sft.bench.outcomes", "--rootdir", str(tmp_path)], cwd=tmp_path, capture_output=True,
                   timeout=120, env={**os.environ, "SFT_TEST_OUTCOMES": str(outcomes), "PYTHONPATH": str(REPO)})
    tests = read(outcomes)
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
