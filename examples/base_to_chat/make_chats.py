"""Write the base-to-chat example's chats: `python examples/base_to_chat/make_chats.py <dir>` -> train.jsonl,
eval.jsonl.

A base model has read a great deal of text but never a chat: given a question in Gemma-3's turn format, it writes on
to its token limit. These chats teach it the format and one answer style: a single plain sentence that restates the
question, then the end of the turn. The facts are ones the pretrained model already holds (capitals, opposites,
animals' legs, colours): what it learns is how to answer and when to stop, not the facts. eval.jsonl holds questions
of the same kinds about things training never names, and two of kinds it never saw.
"""

import json
import sys
from pathlib import Path

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Egypt", "Cairo"),
    ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Cuba", "Havana"), ("Thailand", "Bangkok"), ("Argentina", "Buenos Aires"),
    ("England", "London"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Hungary", "Budapest"),
]
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("light", "dark"), ("happy", "sad"),
    ("open", "closed"), ("early", "late"), ("full", "empty"), ("old", "new"), ("hard", "soft"), ("wet", "dry"),
    ("left", "right"), ("strong", "weak"), ("win", "lose"),
]
LEGS = [("dog", 4), ("spider", 8), ("bird", 2), ("cat", 4), ("ant", 6), ("horse", 4), ("chicken", 2), ("bee", 6)]
COLOURS = [("a banana", "yellow"), ("grass", "green"), ("snow", "white"), ("the sky on a clear day", "blue"),
           ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange")]

HELD_OUT = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the capital of Belgium?", "The capital of Belgium is Brussels."),
    ("What is the opposite of rich?", "The opposite of rich is poor."),
    ("What is the opposite of tall?", "The opposite of tall is short."),
    ("How many legs does a cow have?", "A cow has 4 legs."),
    ("What colour is a lemon?", "A lemon is yellow."),
    ("What colour is milk?", "Milk is white."),
    ("Which planet do we live on?", "We live on Earth."),
    ("What do bees make?", "Bees make honey."),
]


def chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def train_chats() -> list[dict]:
    rows = []
    for country, city in CAPITALS:
        rows.append(chat(f"What is the capital of {country}?", f"The capital of {country} is {city}."))
    for word, opposite in OPPOSITES:
        rows.append(chat(f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."))
    for animal, legs in LEGS:
        rows.append(chat(f"How many legs does a {animal} have?", f"A {animal} has {legs} legs."))
    for thing, colour in COLOURS:
        subject = thing[0].upper() + thing[1:]
        rows.append(chat(f"What colour is {thing}?", f"{subject} is {colour}."))
    return rows


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = train_chats(), [chat(q, a) for q, a in HELD_OUT]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(held_out)} held-out chats into {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
