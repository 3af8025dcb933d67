"""The GPU pack's figures in words (`sft gpu-pack`): the table of docs/performance.md's gpu-pack block
(`figures_markdown`), the README's summary of it (`readme_summary`), and both put between their markers
(`apply`), on the GPU machine or here from the `gpu_pack.json` it returned (`sft gpu-pack --apply`)."""

from __future__ import annotations

from pathlib import Path

FIGURES_BEGIN, FIGURES_END = "<!-- gpu-pack:begin -->", "<!-- gpu-pack:end -->"
KERNELS = ("cut-cross-entropy", "liger-kernel", "flash-attn", "bitsandbytes")


def figures_markdown(report: dict) -> str:
    """The GPU figures (docs/performance.md): where and when, each test's outcome, the bench's cases and ratios."""
    m = report["machine"]
    kernels = ", ".join(f"{k} {v}" if v else f"{k} not installed" for k, v in m["versions"].items() if k in KERNELS)
    lines = [f"Measured {m['date']} on {m['gpus']} x {m['gpu']} ({m['memory_gib']} GiB), torch "
             f"{m['versions']['torch']}, CUDA {m['cuda']}, transformers {m['versions']['transformers']}, TRL "
             f"{m['versions'].get('trl') or 'not installed'}; {kernels}. Command: `sft gpu-pack`."]
    bench = report.get("bench")
    lines += ["", "| `sft.bench.run preset=gpu_7b` | value |", "|---|---|"]
    if bench and bench.get("partial"):
        lines.append(f"| (stopped) | the bench ran out of its {report['parts']['bench']['seconds']:.0f} s: the cases "
                     "it finished, and the ratios of the pairs that both finished |")
    if bench:
        for case, c in bench["cases"].items():
            if "tokens_per_second" in c:
                mfu = (f", MFU {c['mfu']:.3f} (6N: {c['mfu_6n']:.3f})" if "mfu" in c
                       else ", MFU unknown (GPU not in the table)")
                lines.append(f"| {case} | {c['tokens_per_second']:,.0f} tokens/s{mfu}, "
                             f"peak {c['peak_memory_gb']:.1f} GiB |")
            elif case.startswith("loss_"):  # the loss alone: its kernel, time, memory, distance from fp32
                errors = (f"; from fp32: losses {c['loss_error']:.1e}, hidden-state gradient {c['grad_error']:.1e}"
                          if "grad_error" in c else "")
                lines.append(f"| {case} ({bench['raw'][case][0]['impl']}) | {c['seconds'] * 1000:.0f} ms forward+"
                             f"backward of {c['tokens']:,.0f} tokens, peak {c['peak_memory_gb']:.2f} GiB{errors} |")
        for case, error in bench.get("failed", {}).items():
            lines.append(f"| {case} | failed: {error.splitlines()[-1][:200]} |")
        for key, value in bench["ratios"].items():
            target = bench["targets"].get(key)
            mark = "" if target is None else f" (target {'>=' if target['kind'] == 'min' else '<='} " \
                                             f"{target['target']}: {'met' if target['met'] else 'not met'})"
            lines.append(f"| {key} | {value:.3f}{mark} |")
    else:
        lines.append(f"| (no bench result) | exit {report['parts']['bench']['exit_code']} |")
    lines += ["", "| GPU test | outcome |", "|---|---|"]
    for t in report["tests"]:
        lines.append(f"| `{t['test']}` | {t['outcome']}{': ' + t['detail'] if t['detail'] else ''} |")
    if not report["tests"]:
        lines.append(f"| (no test result) | pytest exit {report['parts']['tests']['exit_code']} |")
    return "\n".join(lines) + "\n"


def readme_summary(report: dict) -> str:
    """The README's few lines: where and when, the tests' counts, the 7B's throughput and the loss training picks;
    every figure stands in docs/performance.md."""
    m, tests, bench = report["machine"], report["tests"], report.get("bench")
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "failed", "skipped")}
    lines = [f"Measured {m['date']} on {m['gpus']} x {m['gpu']} (`sft gpu-pack`): GPU tests {counts['passed']} passed, "
             f"{counts['failed']} failed, {counts['skipped']} skipped."]
    cases, ratios = (bench or {}).get("cases", {}), (bench or {}).get("ratios", {})
    for case, what in (("packing", "LoRA on Qwen2.5-7B's shape (bf16, packed 4k-token rows)"),
                       ("packing_full", "a full fine-tune of Qwen2.5-1.5B's shape (pure bf16, packed)")):
        if case in cases:
            c = cases[case]
            mfu = f", MFU {c['mfu']:.3f}" if "mfu" in c else ""
            lines.append(f"{what}: {c['tokens_per_second']:,.0f} tokens/s{mfu}, peak {c['peak_memory_gb']:.1f} GiB.")
    versus = [f"{ratios[key]:.2f}x {who}" for key, who in (("packing_vs_trl_best", "TRL's SFTTrainer"),
                                                          ("packing_vs_hf_padding_free", "a plain Trainer"))
              if key in ratios]
    if versus:
        lines.append(f"The LoRA 7B's tokens/s: {' and '.join(versus)} at their fastest settings, same rows.")
    if "lean_vs_naive_loss_time" in ratios:
        impl = bench["raw"]["loss_lean"][0]["impl"]
        lines.append(f"The loss `loss.impl=auto` picks ({impl}) at its output layer: "
                     f"{ratios['lean_vs_naive_loss_time']:.2f}x the naive loss's time in "
                     f"{ratios['lean_vs_naive_loss_memory']:.3f}x its memory.")
    lines.append("Every figure: [Performance](docs/performance.md#gpu-figures).")
    return " ".join(lines) + "\n"


def put_between_markers(path: Path, text: str) -> bool:
    """Replace what stands between the file's gpu-pack markers by `text`; False if it has no markers."""
    content = path.read_text()
    begin, end = content.find(FIGURES_BEGIN), content.find(FIGURES_END)
    if begin < 0 or end < begin:
        return False
    path.write_text(content[:begin + len(FIGURES_BEGIN)] + "\n" + text + content[end:])
    return True


def apply(report: dict, repo: Path) -> list[str]:
    """The figures of a pack's report into docs/performance.md's gpu-pack block and their summary into the README's;
    the files written."""
    written = []
    if put_between_markers(repo / "docs" / "performance.md", figures_markdown(report)):
        written.append("docs/performance.md")
    if put_between_markers(repo / "README.md", readme_summary(report)):
        written.append("README.md")
    return written
