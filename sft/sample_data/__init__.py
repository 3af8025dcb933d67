"""The bundled sample task: multi-digit addition whose `difficulty_score` measures real difficulty.

The score grows with the number of digits and of carries, the two things that make addition hard for a
small language model, so the hard-sample loss has something true to weight. Rows are generated
deterministically (`python -m sft.sample_data` rewrites the committed files byte for byte).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TRAIN_FILE = HERE / "train.jsonl"
EVAL_FILE = HERE / "validation.jsonl"

SYSTEM_PROMPT = "You add numbers."
QUESTION_FORMS = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.")


def count_carries(a: int, b: int) -> int:
    """Number of carry operations in the column addition of a and b."""
    carries, carry = 0, 0
    while a or b:
        carry = 1 if (a % 10 + b % 10 + carry) >= 10 else 0
        carries += carry
        a, b = a // 10, b // 10
    return carries


def difficulty(a: int, b: int) -> float:
    """Difficulty in [0.5, 5]: half a point per digit of the longer operand plus half a point per carry."""
    digits = max(len(str(a)), len(str(b)))
    return round(min(5.0, 0.5 * digits + 0.5 * count_carries(a, b)), 2)


def make_row(rng: random.Random) -> dict:
    """One chat: a question about a sum and its answer; some rows have a system turn or a second turn."""
    a = rng.randint(0, 10 ** rng.randint(1, 4) - 1)
    b = rng.randint(0, 10 ** rng.randint(1, 4) - 1)
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": rng.choice(QUESTION_FORMS).format(a=a, b=b)})
    messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}"})
    score = difficulty(a, b)
    if rng.random() < 0.15:  # a follow-up turn, so that masking is exercised on every assistant turn
        c = rng.randint(0, 10 ** rng.randint(1, 3) - 1)
        messages.append({"role": "user", "content": f"Now add {c}."})
        messages.append({"role": "assistant", "content": f"{a + b} + {c} = {a + b + c}"})
        score = max(score, difficulty(a + b, c))
    return {"messages": messages, "difficulty_score": score}


def generate(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_row(rng) for _ in range(n)]


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    write_jsonl(generate(4000, seed=0), TRAIN_FILE)
    write_jsonl(generate(400, seed=1), EVAL_FILE)
    print(f"wrote {TRAIN_FILE} and {EVAL_FILE}")


if __name__ == "__main__":
    main()
