"""The data stage, in rooms, each a package of one concept, lowest first (a room imports only rooms before it,
`tests/test_layout.py` holds it, and each room's `__init__` says what it may import):

- `rows/`: where rows come from (files, globs, saved datasets, the hub), their formats, each row read and validated;
- `spec`: the `data` node, one `DataSpec` (it names the formats and checks the sources' files);
- `chat/`: a conversation rendered with the model's chat template, and where each trained answer lies in it
  (reasoning, tool calls, the ways out a refusal offers);
- `tokens/`: the views tokenised and labelled, the loss's static weights, a split's columns, batches and the
  collator;
- `splits/`: the cached preprocessing, streams and mixtures.

`load` sits on top and puts them together, taking the config whole:

    load_sft_datasets(DataSpec(train_file="train.jsonl"), tokenizer, loss)  ->  SFTData(train, eval, ...)

It imports nothing of the loss or training stages: the loss tells it what it needs through its own interface.
"""
