"""Splits: a source's rows validated, tokenised on every core and cached by what decides them (`preprocess`), read as
a stream larger than memory or the disk (`streaming`), or drawn from several sources into a mixture (`mixture`).
`sft.data.load` puts them together as the run's train and eval splits.

May import: `config base`, `sft.data.rows`, `sft.data.spec`, `sft.data.chat`, `sft.data.tokens`."""
