"""The rows the bench's data cases read: one-turn additions (`synthetic_rows`), multi-turn chats with worked
additions (`multi_turn_rows`) and chats with a published dataset's length spread (`spread_rows`), generated one by
one (a million rows take no memory to make)."""

from __future__ import annotations

import json
from pathlib import Path


def synthetic_rows(path: Path, rows: int) -> None:
    """`rows` chats in the bundled data's format: distinct additions, so none is a duplicate."""
    from sft.sample_data import SYSTEM_PROMPT

    with open(path, "w") as f:
        for i in range(rows):
            a, b = 7919 * i % 100003, 104729 * i % 99991
            f.write(json.dumps({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                             {"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a} + {b} = {a + b}"}],
                                "difficulty_score": 1.0 + i % 4}) + "\n")


def multi_turn_rows(path: Path, rows: int, turns: int = 2) -> None:
    """`rows` chats of a system turn and `turns` additions worked column by column, about 300 tokens each (the
    tiny tokenizer's), written one by one (a million rows take no memory to make)."""
    from sft.sample_data import SYSTEM_PROMPT

    def worked(a: int, b: int) -> str:
        steps, carry, x, y = [], 0, a, b
        while x or y or carry:
            total = x % 10 + y % 10 + carry
            steps.append(f"{x % 10} + {y % 10}{' + 1' if carry else ''} = {total}, write {total % 10}"
                         + (", carry 1" if total >= 10 else ""))
            carry, x, y = total // 10, x // 10, y // 10
        return "; ".join(steps) + f". So {a} + {b} = {a + b}."

    with open(path, "w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}]
            for turn in range(turns):
                a, b = 10 + (7919 * i + 31 * turn) % 9990, 10 + (104729 * i + 17 * turn) % 9990
                messages += [{"role": "user", "content": f"Add {a} and {b}, column by column."},
                             {"role": "assistant", "content": worked(a, b)}]
            f.write(json.dumps({"messages": messages, "difficulty_score": 1.0 + i % 4}) + "\n")


# The length spread of a published SFT dataset: LLaMA-Factory's data/alpaca_en_demo.json (999 rows; its commit
# ff6d4d12e, read 2026-12-04), each row's prompt (instruction and input) and answer in SmolLM2-135M-Instruct's tokens,
# the rows sorted by their sum and cut into 32 equal groups: each group's median (prompt, answer). Its chats are 47
# to 750 tokens as SmolLM2's template renders them (median 162, mean 201): what packing is for.
ALPACA_EN_DEMO_TOKENS = [
    (12, 7), (15, 8), (19, 8), (18, 13), (18, 15), (22, 14), (20, 20), (18, 28), (23, 24), (23, 31), (24, 37),
    (19, 56), (15, 70), (16, 82), (19, 90), (14, 107), (14, 120), (14, 133), (12, 150), (13, 165), (13, 184),
    (11, 202), (14, 220), (11, 250), (11, 270), (12, 290), (12, 309), (12, 330), (11, 357), (12, 379), (12, 407),
    (15, 492)]
WORDS = "the cat sat on a mat and then it ran to see what was there in the big old house by the sea".split()


def spread_rows(path: Path, rows: int) -> None:
    """`rows` one-turn chats whose prompt and answer lengths follow `ALPACA_EN_DEMO_TOKENS` (each of its 32 groups
    in turn, shuffled by a fixed stride), in words that are one token each in SmolLM2's vocabulary (more in the tiny
    model's): chats of a real length spread, where padding to the longest row of a batch wastes what packing saves."""
    with open(path, "w") as f:
        for i in range(rows):
            prompt, answer = ALPACA_EN_DEMO_TOKENS[(i * 13) % len(ALPACA_EN_DEMO_TOKENS)]
            words = [WORDS[(7 * i + k) % len(WORDS)] for k in range(prompt + answer)]
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:prompt]).capitalize() + "?"},
                                             {"role": "assistant", "content": " ".join(words[prompt:]) + "."}],
                                "difficulty_score": 1.0 + i % 4}) + "\n")


# The length spread of the chats users fine-tune on: a log-normal with the published median and mean token counts
# of nvidia's Llama-Nemotron-Post-Training-Dataset-v1 (393 and 528 tokens a row, min 14, max 18,718: its ShareGPT
# conversion's dataset card, MaziyarPanahi/Llama-Nemotron-Post-Training-Dataset-v1-ShareGPT), cut to 100-4,000 tokens;
# four fifths of its tokens are the answers' (12.83B of 15.97B). A fit to two published figures, not a measured
# histogram: the rows a step of 64k tokens holds as users' data does (about 120 chats of 100 to 4,000 tokens), where
# the 7B check once packed additions of 33-86 tokens (attention 0.1% of its FLOPs).
REALISTIC_MEDIAN, REALISTIC_MEAN, REALISTIC_RANGE, ANSWER_SHARE = 393, 528, (100, 4000), 0.8


def realistic_lengths(rows: int, seed: int = 0) -> list[int]:
    """`rows` chat lengths in tokens from the spread above (a fixed seed: the same rows in every case and run)."""
    import math
    import random

    mu, sigma = math.log(REALISTIC_MEDIAN), math.sqrt(2 * math.log(REALISTIC_MEAN / REALISTIC_MEDIAN))
    rng = random.Random(seed)
    low, high = REALISTIC_RANGE
    return [min(high, max(low, round(rng.lognormvariate(mu, sigma)))) for _ in range(rows)]


def realistic_rows(path: Path, rows: int, tokenizer) -> None:
    """`rows` one-turn chats of `realistic_lengths` tokens in `tokenizer`'s vocabulary (a fifth the question, the rest
    the answer; its tokens a word measured once on the words used)."""
    sample = " ".join(WORDS * 8)
    per_word = len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / (8 * len(WORDS))
    with open(path, "w") as f:
        for i, tokens in enumerate(realistic_lengths(rows)):
            length = max(8, round(tokens / per_word))
            prompt = max(4, round(length * (1 - ANSWER_SHARE)))
            words = [WORDS[(7 * i + 3 * k + k // len(WORDS)) % len(WORDS)] for k in range(length)]
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:prompt]).capitalize() + "?"},
                                             {"role": "assistant", "content": " ".join(words[prompt:]) + "."}],
                                "difficulty_score": 1.0 + i % 4}) + "\n")
