"""Before and after, side by side: `sft compare run=<run dir> rows=<chats.jsonl> [merged=<dir>] [out=<file>]`.

Each row's chat up to its last answer is the prompt; the base model (the one the run's saved config names:
`model.name_or_path`, `model.gguf_file`) and the trained one (the run's `model/`: an adapter over that base, or a
full model; or `merged=<dir>`, a model `sft merge` wrote) answer it greedily, prompted as training
rendered chats (`sft.eval.generation`). Prints a table of the answers beside the reference, and the exact match of
each model (stripped answer equal to the reference) and how many of its answers ended at a stop token rather than
at `max_new_tokens`; `out=` also writes the table as Markdown:

    | prompt | reference | before | after |
    | Who is your creator? | I'm Quill, an AI assistant made by Fennel Lab. | I was created by ... | I'm Quill, ... |
    exact match: before 0/10, after 9/10; ended at a stop token: before 4/10, after 10/10
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class CompareConfig:
    run: str = "???"  # the run dir (its .hydra/config.yaml names the base model; model/ is the trained one)
    rows: str = "???"  # chats (JSONL), each ending with the reference answer
    merged: Optional[str] = None  # a merged model to use as the trained one instead of the run's model/
    max_new_tokens: int = 64
    out: Optional[str] = None  # also write the table as Markdown here


@dataclass
class Answers:
    """One model's greedy answers to the prompts, and whether each ended at a stop token."""

    texts: list[str]
    stopped: list[bool]

    def exact(self, references: list[str]) -> int:
        from sft.eval.generation import exact_match

        return int(sum(exact_match(a, r) for a, r in zip(self.texts, references)))


def answers(model, tokenizer, rows: list[dict], max_new_tokens: int) -> Answers:
    """`model`'s greedy answers to `rows` (`sft.eval.generation.greedy_ids`: cut at the first stop token)."""
    from sft.eval.generation import greedy_ids

    ids = greedy_ids(model, tokenizer, rows, max_new_tokens, batch_size=8)
    return Answers([tokenizer.decode(i, skip_special_tokens=True) for i in ids],
                   [len(i) < max_new_tokens for i in ids])


def compare(run: str, rows_file: str, merged: str | None = None, max_new_tokens: int = 64) -> tuple[list, Answers,
                                                                                                       Answers]:
    """The rows, the base model's answers and the trained model's."""
    from hydra.utils import instantiate

    from sft.config.registry import register
    from sft.data.rows.reading import read_jsonl
    from sft.model.merge import run_config

    register()
    saved = run_config(Path(run))
    if saved is None:
        raise ValueError(f"{run}: no .hydra/config.yaml here: run= is a run dir of sft.train")
    rows = read_jsonl(rows_file, default_score=1.0)
    tokenizer = instantiate(saved.tokenizer)
    base = instantiate(saved.model, attn_implementation="sdpa")
    before = answers(base, tokenizer, rows, max_new_tokens)
    trained = Path(merged) if merged else Path(run) / "model"
    if (trained / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(base, str(trained))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(trained))
    return rows, before, answers(model, tokenizer, rows, max_new_tokens)


def table(rows: list[dict], before: Answers, after: Answers) -> str:
    """The answers as a Markdown table, and a line of totals."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "⏎ ")

    references = [r["messages"][-1].get("content") or "" for r in rows]
    lines = ["| prompt | reference | before | after |", "| --- | --- | --- | --- |"]
    for row, reference, b, a in zip(rows, references, before.texts, after.texts):
        lines.append(f"| {cell(row['messages'][-2]['content'])} | {cell(reference)} | {cell(b)} | {cell(a)} |")
    n = len(rows)
    lines.append(f"\nexact match: before {before.exact(references)}/{n}, after {after.exact(references)}/{n}; ended at "
                 f"a stop token: before {sum(before.stopped)}/{n}, after {sum(after.stopped)}/{n}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from sft.config.schema import ConfigError
    from sft.data.rows.reading import DataError

    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(CompareConfig), OmegaConf.from_dotlist(argv))
        rows, before, after = compare(cfg.run, cfg.rows, cfg.merged, cfg.max_new_tokens)
    except (ValueError, OSError, OmegaConfBaseException, DataError, ConfigError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        print("usage: sft compare run=<run dir> rows=<chats.jsonl> [merged=<dir>] [max_new_tokens=64] "
              "[out=<file.md>]", file=sys.stderr)
        sys.exit(2)
    text = table(rows, before, after)
    print(text, end="")
    answers = json.dumps(
        {"before": before.__dict__, "after": after.__dict__,
         "references": [r["messages"][-1].get("content") or "" for r in rows],
         "prompts": [next((m.get("content") or "" for m in reversed(r["messages"][:-1]) if m["role"] == "user"), "")
                     for r in rows],
         "difficulty_scores": [r.get("difficulty_score") for r in rows]}, indent=1) + "\n"
    if cfg.out:
        Path(cfg.out).write_text(text)
        Path(cfg.out).with_suffix(".json").write_text(answers)
    # beside the run, for its page (report.html, written again with them)
    from sft.files import own_path, write_text
    from sft.run.train import write_page

    write_text(own_path(Path(cfg.run) / "compare.json"), answers)
    write_page(cfg.run)


if __name__ == "__main__":
    main()
