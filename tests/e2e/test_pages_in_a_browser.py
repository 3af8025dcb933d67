"""The pages (`sft.experiments.pages`) in a real browser: Debian's Chromium, headless, loading `report.html` from a
`file://` URL with the network off. What is checked is the page as rendered (the DOM after its script ran), not the
HTML text: each chart draws as many points as `metrics.jsonl` has, the sweep's verdict reads as `sweep_summary.md`'s,
a failed job is marked, a NaN is a gap, a row holding `<script>` is shown and not run, nothing errs, and a 1,000-step
run's page with 50 eval rows is drawn in under 2 s. Screenshots of both pages are written for the docs."""

import json
import math
import random
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, SMALL_EVAL

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = REPO / "outputs" / "screenshots"  # for the docs (docs/images holds the chosen ones)


def browse(tmp_path, page, screenshot=None) -> tuple[str, str]:
    """The page's DOM once its script ran, and the browser's own log (console messages included); offline."""
    if CHROMIUM is None:
        pytest.skip("no Chromium (apt-get install chromium; .ci/run installs it)")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium'}", "--proxy-server=127.0.0.1:9",
             "--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0"]
    if screenshot:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        subprocess.run([*flags, "--window-size=1280,1400", f"--screenshot={SCREENSHOTS / screenshot}",
                        page.as_uri()], capture_output=True, timeout=120)
    proc = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    return proc.stdout, proc.stderr


def rendered(dom: str) -> dict:
    body = re.search(r"<body([^>]*)>", dom).group(1)
    errors = json.loads(re.search(r'data-errors="([^"]*)"', body).group(1).replace("&quot;", '"'))
    charts = dict(re.findall(r'data-title="([^"]+)"[^>]*data-points="(\d+)"', dom))
    return {"errors": errors, "ms": int(re.search(r'data-rendered-ms="(\d+)"', body).group(1)),
            "points": {k: int(v) for k, v in charts.items()}}


def console_errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "CONSOLE" in line and ("Uncaught" in line or "Error" in line)]


def sft(*args, code: int = 0):
    proc = subprocess.run([sys.executable, "-m", "sft", *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == code, proc.stderr[-3000:]
    return proc


HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'">'


def test_a_runs_page_draws_every_logged_point_shows_hostile_text_as_text_and_says_what_is_missing(tmp_path):
    run = tmp_path / "run"
    sft("train", "trainer.max_steps=12", "trainer.logging_steps=1", "trainer.eval_steps=6", f"data.eval_file={SMALL_EVAL}",
        f"hydra.run.dir={run}")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with open(run / "metrics.jsonl", "a") as f:  # a NaN loss logged: a gap, not a point
        f.write('{"step": 13, "loss": NaN, "grad_norm": 1.0}\n')
    (run / "compare.json").write_text(json.dumps({
        "before": {"texts": [HOSTILE, "5"], "stopped": [True, True]}, "after": {"texts": ["4", "5"],
                                                                                 "stopped": [True, True]},
        "references": ["4", "5"], "prompts": [HOSTILE, "2+3?"], "difficulty_scores": [0.5, 3.5]}))
    page = run / "report.html"
    assert page.is_file()  # written at the end of the run
    sft("report", str(run), "--html")  # again, with the answers and the NaN
    dom, log = browse(tmp_path, page, screenshot="run_page.png")
    shown = rendered(dom)
    assert shown["errors"] == [] and not console_errors(log), (shown["errors"], console_errors(log))
    losses = [m for m in metrics if isinstance(m.get("loss"), float)]
    assert shown["points"]["loss"] == len(losses)  # the NaN drew nothing
    assert shown["points"]["eval loss"] == len([m for m in metrics if "eval_loss" in m])
    assert shown["points"]["learning rate"] == len([m for m in metrics if "learning_rate" in m])
    assert shown["points"]["peak memory"] == len([m for m in metrics if "peak_memory_gb" in m]) > 0
    assert "<title>Run run</title>" in dom and "pwned" not in re.search(r"<title>.*?</title>", dom).group(0)
    assert "&lt;script&gt;document.title" in dom and "<img src=\"x\"" not in dom  # shown as text, not run
    assert "exact: before 1/2, after 2/2" in dom
    empty = tmp_path / "empty"
    empty.mkdir()
    sft("report", str(empty), "--html")
    dom, _ = browse(tmp_path, empty / "report.html")
    assert "no metrics.jsonl: nothing was logged" in dom and "no results.json" in dom


def test_a_sweeps_page_reads_as_its_summary_marks_the_failed_job_and_links_each_jobs_page(tmp_path):
    sweep = tmp_path / "sweep"
    sft("train", "-m", "loss=ce,hard_sample", "clip.max_norm=1,-1", "trainer.seed=1,2", "trainer.max_steps=4", f"data.eval_file={SMALL_EVAL}",
        f"hydra.sweep.dir={sweep}", code=3)  # its failed jobs: exit 3 (sft.experiments.sweep), after the report
    dom, log = browse(tmp_path, sweep / "report.html", screenshot="sweep_page.png")
    shown = rendered(dom)
    assert shown["errors"] == [] and not console_errors(log)
    summary = (sweep / "sweep_summary.md").read_text()
    said = [line[2:].replace("**", "") for line in summary[summary.index("## Verdict"):].splitlines()[2:]
            if line.startswith("- ")][:3]
    verdict = re.search(r'<ul class="verdict" id="verdict">(.*?)</ul>', dom, re.S).group(1)
    items = [re.sub(r"<[^>]+>", "", item) for item in re.findall(r"<li>(.*?)</li>", verdict, re.S)]
    assert items[:len(said)] == [s.replace("&", "&amp;") for s in said] and any("against" in i for i in items)
    assert dom.count('<tr class="failed">') == 4  # the four jobs with clip.max_norm=-1
    assert shown["points"]["train loss"] == sum(
        len([line for line in (sweep / str(j) / "metrics.jsonl").read_text().splitlines() if '"loss"' in line])
        for j in range(8) if (sweep / str(j) / "metrics.jsonl").is_file())
    assert re.search(r'<a href="0/report.html">0</a>', dom)
    by_bucket = dom[dom.index('data-title="eval loss by bucket, per setting"'):]
    ticks = re.findall(r'<g class="xtick">.*?>([^<>]+)</text>', by_bucket[:by_bucket.find("data-title=", 10)])
    assert ticks and all(re.fullmatch(r"bucket \d+", t) for t in ticks), ticks  # one category a bucket


def test_a_thousand_step_runs_page_with_fifty_answers_is_drawn_in_under_two_seconds(tmp_path):
    rng = random.Random(0)
    lines = []
    for step in range(1, 1001):
        lines.append({"step": step, "loss": 3 * math.exp(-step / 200) + rng.random() / 10, "learning_rate": 1e-3,
                      "grad_norm": 1 + rng.random(), "tokens_per_second": 1000.0})
        if step % 20 == 0:
            lines.append({"step": step, "eval_loss": 2.0, "eval_loss_bucket_0": 1.5, "eval_loss_bucket_1": 2.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "compare.json").write_text(json.dumps({
        "before": {"texts": ["a"] * 50, "stopped": [True] * 50}, "after": {"texts": ["b"] * 50, "stopped": [True] * 50},
        "references": ["b"] * 50, "prompts": ["q"] * 50, "difficulty_scores": [1.0] * 50}))
    sft("report", str(tmp_path), "--html")
    shown = rendered(browse(tmp_path, tmp_path / "report.html")[0])
    assert shown["errors"] == [] and shown["points"]["loss"] == 1000 and shown["points"]["eval loss"] == 50
    assert shown["ms"] < 2000, shown["ms"]
