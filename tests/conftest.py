"""Shared fixtures: a private sft cache per test session, the tiny tokenizer, small data files."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Every test (and subprocess) builds the tiny model and data caches in a fresh place, never in ~/.cache.
os.environ.setdefault("SFT_CACHE", tempfile.mkdtemp(prefix="sft-test-cache-"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tokenizer():
    from sft.model import load_tokenizer

    return load_tokenizer("tiny")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(question: str, answer: str, score: float = 1.0) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "difficulty_score": score}


def run_train(*overrides: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m sft.train overrides...` in a subprocess, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "sft.train", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`./launch.sh args...` (accelerate launch) in a subprocess, on a free port."""
    return subprocess.run(
        [str(REPO / "launch.sh"), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "MASTER_PORT": str(free_port()), **(env or {})},
    )


def step_losses(run_dir: Path, step: int) -> list[float]:
    """Training losses logged at every step up to `step`, from that checkpoint's trainer_state.json."""
    state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


def run_patched(patch: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m sft.train overrides...` with `patch` (Python source) executed first: fault injection."""
    script = f"import sys\n{patch}\nsys.argv = ['sft.train', *{list(overrides)!r}]\nfrom sft.train import cli\ncli()\n"
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def log_history(run_dir: Path, step: int) -> list[dict]:
    return json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]
