"""A run's and a sweep's page (`sft.experiments.pages`), as data and text: every text travels as inert JSON (a row
holding `</script>` cannot close the element it is in), non-finite numbers as gaps, and what is missing is said.
How the pages render: tests/e2e/test_pages_in_a_browser.py, in a real browser."""

import json
import math

from sft.experiments.pages import PAGE, run_data, write_run_page

HOSTILE = '</script><script>document.title="pwned"</script><img src=x onerror=alert(1)>'


def payload(html: str) -> dict:
    start = html.index('<script type="application/json" id="sft-data">') + len(
        '<script type="application/json" id="sft-data">')
    text = html[start:html.index("</script>", start)]
    return json.loads(text.replace("<\\/", "</"))


def test_hostile_text_cannot_leave_the_data_and_nan_is_a_gap(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "eval_loss": 1.9})).replace(
        '"loss": 1.5', '"loss": NaN'))
    (tmp_path / "compare.json").write_text(json.dumps({
        "before": {"texts": [HOSTILE], "stopped": [True]}, "after": {"texts": ["4"], "stopped": [True]},
        "references": ["4"], "prompts": [HOSTILE], "difficulty_scores": [1.0]}))
    html = write_run_page(tmp_path).read_text()
    assert (tmp_path / PAGE).is_file() and html.count("</script>") == 3  # Plotly's, the data's and the page's own
    data = payload(html)
    assert data["answers"]["prompts"] == [HOSTILE] and data["answers"]["before"]["texts"] == [HOSTILE]
    assert data["series"]["train loss"] == {"x": [1, 2], "y": [2.0, None]}  # NaN: a gap, not a point
    assert not any(isinstance(v, float) and math.isnan(v) for v in data["series"]["train loss"]["y"])


def test_a_run_dir_without_metrics_is_a_page_that_says_so(tmp_path):
    data = run_data(tmp_path)
    assert data["has_metrics"] is False and data["series"] == {} and data["results"] is None
    assert write_run_page(tmp_path).is_file()  # what the browser shows of it: tests/e2e/test_pages_in_a_browser.py
