"""The rows the bench's data cases read: one-turn additions (`synthetic_rows`) and multi-turn chats with worked
additions (`multi_turn_rows`), generated one by one (a million rows take no memory to make)."""

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
