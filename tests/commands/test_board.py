"""`sft board`: the pages of the runs and sweeps under the given dirs, served read-only on 127.0.0.1, newest first,
and nothing outside those dirs (however the path is spelled)."""

import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sft.commands.board import serve
from sft.experiments.pages import PAGE


def a_run(folder: Path, losses: list[float], mtime: float, finished: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": loss}) + "\n"
                                                  for i, loss in enumerate(losses)))
    if finished:
        (folder / "results.json").write_text(json.dumps({"status": "ok", "global_step": len(losses)}))
    for path in folder.iterdir():
        os.utime(path, (mtime, mtime))
    return folder


@pytest.fixture
def board(tmp_path):
    root = tmp_path / "outputs"
    a_run(root / "older", [2.0, 1.5], mtime=1_000_000_000)
    a_run(root / "deep" / "newer", [3.0, 2.5, 2.0], mtime=1_900_000_000)
    a_run(root / "running", [4.0], mtime=1_500_000_000, finished=False)
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    server = serve([root], port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def get(url: str, method: str = "GET") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_the_index_lists_every_run_newest_first_and_links_its_page(board):
    url, server = board
    assert server.server_address[0] == "127.0.0.1"  # this machine only, unless told otherwise
    code, text = get(url + "/")
    assert code == 200
    order = [text.index(name) for name in ("deep/newer", "running", "older")]
    assert order == sorted(order)  # newest first
    assert "running or interrupted" in text and f'href="/r0/deep/newer/{PAGE}"' in text


def test_a_run_page_is_served_from_its_dir_and_a_running_one_reloads_itself(board):
    url, _ = board
    code, text = get(f"{url}/r0/deep/newer/{PAGE}")
    assert code == 200 and '"train loss": {"x": [1, 2, 3], "y": [3.0, 2.5, 2.0]}' in text
    assert 'http-equiv="refresh"' not in text  # finished: the page stays
    code, text = get(f"{url}/r0/running/{PAGE}")
    assert code == 200 and 'http-equiv="refresh"' in text


@pytest.mark.parametrize("path", [f"/r0/../secret/{PAGE}", f"/r0/%2e%2e/secret/{PAGE}", f"/r1/older/{PAGE}",
                                  "/r0/older/metrics.jsonl", "/etc/passwd", f"/r0/nowhere/{PAGE}"])
def test_a_path_outside_the_served_dirs_or_not_a_page_is_refused(board, path):
    url, _ = board
    code, text = get(url + path)
    assert code == 403 and "9.0" not in text


def test_a_link_out_of_the_served_dirs_is_refused(board, tmp_path):
    url, _ = board
    (tmp_path / "outputs" / "escape").symlink_to(tmp_path / "secret")
    assert get(f"{url}/r0/escape/{PAGE}")[0] == 403


def test_the_board_is_read_only(board):
    url, _ = board
    for method in ("POST", "PUT", "DELETE"):
        assert get(f"{url}/r0/older/{PAGE}", method)[0] == 405
