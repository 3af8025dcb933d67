"""Every recipe of `examples/` runs as its README says: the commands of its `## Run` block, exactly, at CPU size
(only the run and sweep dirs moved into a temporary folder; the GGUF export left out, and said, where llama-cpp-python
is not installed), and does what its README says it does."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, free_port

EXAMPLES = REPO / "examples"
RECIPES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "README.md").is_file())


def run_block(name: str) -> str:
    """The ```bash block under `## Run` of an example's README."""
    readme = (EXAMPLES / name / "README.md").read_text()
    found = re.search(r"^## Run\n.*?```bash\n(.*?)```", readme, re.S | re.M)
    assert found, f"examples/{name}/README.md has no ## Run block"
    return found.group(1)


# Recipes on the real model run at reduced size: overrides added to their `sft train` line (before its run dir)
REDUCED = {"identity": "trainer.max_steps=15 trainer.eval_steps=15 trainer.save_steps=15"}  # 30 steps in its README


def run_recipe(name: str, tmp_path: Path, extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    """Run an example's commands with bash from the repo root, its output dir in `tmp_path`; that dir. `extra_env`:
    the test cluster's (SLURM_CONF) for the SLURM recipe."""
    out = tmp_path / name
    commands = run_block(name).replace(f"outputs/examples/{name}", str(out)).replace(
        f"multirun/examples/{name}", str(out))
    if name == "identity" and importlib.util.find_spec("llama_cpp") is None:  # its quantizer: check_identity says so
        commands = "\n".join(line for line in commands.splitlines() if not line.startswith("sft export gguf"))
    if name in REDUCED:  # every run of the recipe (later overrides win)
        assert commands.count(f"hydra.run.dir={out}/") >= 1, commands
        commands = commands.replace(f"hydra.run.dir={out}/", f"{REDUCED[name]} hydra.run.dir={out}/")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MASTER_PORT": str(free_port()), "HYDRA_FULL_ERROR": "1", **(extra_env or {})}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc, out


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def test_every_example_has_a_check():
    assert set(RECIPES) == set(CHECKS)


def check_own_data_lora(proc, out):
    r = results(out)
    assert r["status"] == "ok" and r["global_step"] == 30 and r["eval_loss"] < r["eval_loss_initial"]
    assert (out / "model" / "adapter_model.safetensors").is_file() and (out / "checkpoint-30").is_dir()


def check_sharded(proc, out):
    r = results(out)
    assert r["status"] == "ok" and r["global_step"] == 6 and r["eval_loss"] < r["eval_loss_initial"]
    from safetensors.torch import load_file

    adapter = load_file(out / "model" / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())  # whole, not a rank's empty shard


def check_mixture(proc, out):
    r = results(out)
    assert {"eval_ce_task_chat", "eval_ce_task_math", "eval_loss_task_chat", "eval_loss_task_math"} <= set(r)
    assert "data.mixture: math:" in (out / "train.log").read_text()


def check_tool_calling(proc, out):
    shown = proc.stdout
    assert '⟦<tool_call>\n{"name": "get_weather", "arguments": {"city":' in shown or \
           '⟦<tool_call>\n{"name": "add"' in shown, shown[:2000]
    assert "<tool_response>" in shown and "⟦<tool_response>" not in shown
    r = results(out)
    assert r["status"] == "ok" and r["eval_gen/tool_calls_malformed"] >= 0
    # every prompt of calls_eval.jsonl expects one call: a turn is right exactly when its call is
    assert 0 <= r["eval_gen/tool_turn_accuracy"] <= r["eval_gen/tool_call_accuracy"] <= 1


def check_own_loss(proc, out):
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    logged = [e for e in state["log_history"] if "aux/contrastive" in e]
    assert [e["step"] for e in logged] == [1, 2, 4, 6, 8] and all(e["aux/contrastive"] > 0 for e in logged)


def check_own_controller(proc, out):
    r = results(out)
    assert r["reached_target_at"] is not None and r["global_step"] == r["reached_target_at"] < 200


def check_seed_sweep(proc, out):
    summary = (out / "sweep_summary.md").read_text()
    assert summary.count("2/2") == 2 and "diff_eval_ce" in summary
    assert sorted(p.name for p in out.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]


def check_optuna(proc, out):
    import yaml

    best = yaml.safe_load((out / "optimization_results.yaml").read_text())
    values = [results(out / job)["eval_ce"] for job in ("0", "1", "2")]
    assert best["best_value"] == pytest.approx(min(values))
    assert set(best["best_params"]) == {"loss.alpha", "clip.max_norm"}


def plain_generate(merged: Path, question: str, max_new_tokens: int = 48) -> tuple[str, int]:
    """A merged model's greedy answer to `question` as a server would produce it: `from_pretrained`, the chat template
    with its generation prompt, plain `generate` (which stops at the generation config's eos ids); the text with its
    special tokens, and how many tokens it took."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    generated = generated[0, prompt["input_ids"].shape[1]:]
    return tokenizer.decode(generated), len(generated)


def check_identity(proc, out):
    """The real model learned the identity on held-out phrasings, and stops: through sft.commands.compare, and through plain
    `generate` on the merged model, as a server would run it."""
    r = results(out / "run")
    assert r["status"] == "ok" and r["eval_loss"] < r["eval_loss_initial"] / 10
    compared = json.loads((out / "answers.json").read_text())
    identity = [i for i, ref in enumerate(compared["references"]) if ref.startswith("I'm Quill")]
    assert len(identity) == 8
    assert not any("Quill" in compared["before"]["texts"][i] for i in identity)
    assert sum(compared["after"]["texts"][i].strip() == compared["references"][i] for i in identity) >= 6
    assert all(compared["after"]["stopped"])
    text, tokens = plain_generate(out / "merged", "Who is your creator?")
    assert "Fennel Lab" in text and text.endswith("<|im_end|>") and tokens < 48, text
    check_distilled(out, identity)
    # The Q4_K_M export, in llama.cpp itself: its chat completion with the template and stop token read from the file
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("the rest checked; the GGUF export needs llama-cpp-python (pip install 'sft[gguf]'; ./launch.sh "
                    "installs it)")
    from llama_cpp import Llama

    assert (out / "gguf" / "Modelfile").read_text() == 'FROM ./quill.gguf\nPARAMETER stop "<|im_end|>"\n'
    llm = Llama(model_path=str(out / "gguf" / "quill.gguf"), n_ctx=512, verbose=False)
    rows = [json.loads(line) for line in (out / "data" / "eval.jsonl").read_text().splitlines()]
    served = [llm.create_chat_completion(messages=[m for m in row["messages"] if m["role"] != "assistant"],
                                        max_tokens=48, temperature=0.0)["choices"][0] for row in rows]
    assert all(choice["finish_reason"] == "stop" for choice in served)  # at <|im_end|>, not the token limit
    assert sum(served[i]["message"]["content"].strip() == compared["references"][i] for i in identity) >= 6


def check_distilled(out, identity):
    """A fresh SmolLM2 distilled from the merged model (the teacher's distributions alone, `kd_ratio=1`) answers the
    held-out identity questions as the teacher does."""
    r = results(out / "distilled")
    assert r["status"] == "ok" and r["eval_ce"] < r["eval_history"][0]["eval_ce"] / 10  # its loss is the KL, not ce
    assert "teacher: " in (out / "distilled" / "train.log").read_text()
    compared = json.loads((out / "distilled_answers.json").read_text())
    assert sum(compared["after"]["texts"][i].strip() == compared["references"][i] for i in identity) >= 6
    assert all(compared["after"]["stopped"])


def check_base_to_chat(proc, out):
    """The base model, which wrote on to the token limit, answers held-out questions in the chat format and stops at
    <end_of_turn>: through sft.commands.compare, and through plain `generate` on the merged model."""
    r = results(out / "run")
    assert r["status"] == "ok" and r["eval_loss"] < r["eval_loss_initial"] / 10
    compared = json.loads((out / "answers.json").read_text())
    assert not any(compared["before"]["stopped"])  # the base model: every answer cut at the token limit
    assert all(compared["after"]["stopped"])
    assert sum(a.strip() == ref for a, ref in zip(compared["after"]["texts"], compared["references"])) >= 6
    text, tokens = plain_generate(out / "merged", "What is the capital of Italy?")
    assert "Rome" in text and text.endswith("<end_of_turn>") and tokens < 48, text


def check_slurm(proc, out):
    """Two nodes, one process each, DDP over gloo: the step losses of one process taking the same global batch."""
    from conftest import step_losses

    run = out / "run"
    assert results(run)["status"] == "ok"
    assert json.loads((run / "checkpoint-4" / "sft_state.json").read_text())["world_size"] == 2
    one = out / "one"
    block = run_block("slurm")
    overrides = block[block.index("hydra.run.dir="):].replace("\\\n", " ").split()[1:]
    overrides = [o.replace("per_device_train_batch_size=2", "per_device_train_batch_size=4") for o in overrides]
    done = subprocess.run([sys.executable, "-m", "sft.train", *overrides, f"hydra.run.dir={one}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert step_losses(run, 4) == pytest.approx(step_losses(one, 4), abs=1e-5)


CHECKS = {"own_data_lora": check_own_data_lora, "zero3": check_sharded, "fsdp2": check_sharded,
          "mixture": check_mixture, "tool_calling": check_tool_calling, "own_loss": check_own_loss,
          "own_controller": check_own_controller, "seed_sweep": check_seed_sweep, "optuna": check_optuna,
          "identity": check_identity, "base_to_chat": check_base_to_chat, "slurm": check_slurm}


REAL_MODEL = {"identity": "smollm2_dir", "base_to_chat": "gemma3_dir"}  # recipes on a real model: its fixture


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_the_example_runs_as_its_readme_says(tmp_path, name, request):
    if name in REAL_MODEL:
        request.getfixturevalue(REAL_MODEL[name])  # converted once for the session, or skipped saying why
    cluster = request.getfixturevalue("slurm") if name == "slurm" else None  # the test cluster, or skipped saying why
    proc, out = run_recipe(name, tmp_path, {"SLURM_CONF": cluster.env["SLURM_CONF"]} if cluster else None)
    CHECKS[name](proc, out)
