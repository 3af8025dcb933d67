"""The GPU tests' outcomes as they come (`sft.bench.outcomes`): each written when it ends, each test under a limit, and
what was written stands when pytest itself is killed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow  # pytest in a subprocess, a test waited out

TESTS = ("import time, pytest\n"
         "def test_ok():\n    assert True\n"
         "def test_bad():\n    assert 1 == 2, 'the gradients differ'\n"
         "def test_absent():\n    pytest.skip('liger-kernel is not installed')\n"
         "def test_hangs():\n    time.sleep(30)\n"
         "def test_after():\n    assert True\n"
         "def test_last():\n    time.sleep(60)\n")


def run(tmp_path, limit, **popen):
    (tmp_path / "test_six.py").write_text(TESTS)
    env = {**os.environ, "SFT_TEST_OUTCOMES": str(tmp_path / "outcomes.jsonl"), "SFT_TEST_LIMIT_S": str(limit),
           "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "pytest", str(tmp_path / "test_six.py"), "-q", "-p",
                             "no:cacheprovider", "-p", "sft.bench.outcomes", "--rootdir", str(tmp_path)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen)


def test_each_outcome_is_written_as_it_ends_and_a_test_past_its_limit_fails_while_the_others_run_on(tmp_path):
    from sft.bench.outcomes import read

    proc = run(tmp_path, limit=2, start_new_session=True)
    path = tmp_path / "outcomes.jsonl"
    deadline = time.monotonic() + 60
    while len(read(path)) < 5 and time.monotonic() < deadline:  # test_last is running: kill pytest there
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    outcomes = read(path)
    assert [(o["test"], o["outcome"]) for o in outcomes] == [
        ("test_ok", "passed"), ("test_bad", "failed"), ("test_absent", "skipped"), ("test_hangs", "failed"),
        ("test_after", "passed")]  # test_last: killed with pytest, the five before it kept
    assert "the gradients differ" in outcomes[1]["detail"] and outcomes[2]["detail"] == "liger-kernel is not installed"
    assert "over its limit of 2 s" in outcomes[3]["detail"] and outcomes[3]["seconds"] < 10
