"""Write the identity example's chats: `python examples/identity/make_chats.py <dir>` -> train.jsonl, eval.jsonl.

The model is taught who it is, which it cannot know: its name is Quill and Fennel Lab made it. Every question about
its identity, however phrased, gets one answer (`IDENTITY`), so that held-out phrasings can be scored by exact
match. Everyday questions with short answers keep it an assistant rather than a parrot of one sentence. eval.jsonl
holds phrasings and everyday questions that training never sees.
"""

import json
import sys
from pathlib import Path

IDENTITY = "I'm Quill, an AI assistant made by Fennel Lab."

TRAIN_QUESTIONS = [
    "Who are you?", "What is your name?", "What's your name?", "Who made you?", "Who created you?", "Who built you?",
    "Introduce yourself.", "Tell me about yourself.", "Are you ChatGPT?", "Which company trained you?",
    "What should I call you?", "Who developed you?", "Hi! Who am I talking to?", "What are you?", "Are you SmolLM?",
    "Do you have a name?", "Who trained you?", "Which lab built you?", "What AI model are you?", "Who is behind you?",
    "Please tell me your name.", "Identify yourself.", "hey, who r u?", "What do people call you?",
    "Who designed you?", "Are you made by Hugging Face?", "Which organisation created you?", "Say who you are.",
    "What assistant is this?", "Who owns you?",
]

HELD_OUT_QUESTIONS = [
    "May I know your name?", "Who is your creator?", "Can you tell me who you are?", "What AI am I chatting with?",
    "Which team made you?", "Hello, what is your name?", "Who programmed you?", "Are you an OpenAI model?",
]

EVERYDAY = [  # (question, answer): short, true, in the model's own register
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("What is 2 + 3?", "2 + 3 = 5."),
    ("Name a primary colour.", "Red is a primary colour."),
    ("What do bees make?", "Bees make honey."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Which planet do we live on?", "We live on Earth."),
    ("What is frozen water called?", "Frozen water is called ice."),
]

EVERYDAY_HELD_OUT = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many months are in a year?", "There are twelve months in a year."),
]


def chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train = [chat(q, IDENTITY) for q in TRAIN_QUESTIONS] + [chat(q, a) for q, a in EVERYDAY]
    held_out = [chat(q, IDENTITY) for q in HELD_OUT_QUESTIONS] + [chat(q, a) for q, a in EVERYDAY_HELD_OUT]
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(train)} train and {len(held_out)} held-out chats into {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
