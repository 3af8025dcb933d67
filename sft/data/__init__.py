"""The data stage: rows from sources (`sources`) in their formats (`formats`), validated (`rows`), rendered with the
model's chat template and labelled (`templates`, `turns`, `labels`), preprocessed into a cache (`preprocess`,
`cache`), given the loss's static weights (`weights`), drawn into a mixture (`mixture`), loaded as train and eval
splits (`load`) and batched (`collator`, `batch`). Its config is one `DataSpec` (`spec`), taken whole:

    load_sft_datasets(DataSpec(train_file="train.jsonl"), tokenizer, loss)  ->  SFTData(train, eval, ...)

It imports nothing of the loss or training stages: the loss tells it what it needs through its own interface.
"""
