"""Rows: where a split's rows come from (`sources`: files, globs, saved datasets, the hub), the chat formats users
have, each turned into this project's row (`formats`), and reading a source row by row with each row validated, a
bad one named by its source, line and field (`reading`).

    data/train.jsonl line 7  ->  {"messages": [...], "difficulty_score": ...}   or   DataError("train.jsonl:7: ...")

May import: `config base`."""
