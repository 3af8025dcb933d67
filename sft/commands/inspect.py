"""Show what the model is trained on: `sft inspect [--rows N] [--split train|eval] [overrides]`.

The config and overrides are `sft.train`'s (`model=...`, `data.train_file=...`, `tokenizer.chat_template=...`);
the tokenizer and the data are built as training builds them (validation, chat template, labels,
truncation, the preprocessing cache) and the model is not (except to score the tokens of
`loss=reference_weighted` where its cache has no scores yet, as a run would: `sft.model.reference_scores`).
For the first N sequences of the split it prints the text as the model reads it, the trained tokens
highlighted (green on a terminal, in ⟦brackets⟧ otherwise) with the weight of each trained stretch (a loss's
token weights, e.g. `loss=keywords`, split a turn into stretches), and then the split's totals:

    -- train.jsonl:1 · 52 tokens, 13 trained · sample weight 1
    <|im_start|>system
    You are a helpful assistant.<|im_end|>
    <|im_start|>user
    What is 1 + 1?<|im_end|>
    <|im_start|>assistant
    ⟦2<|im_end|>⟧×1

    ...
    train: 800 rows read, 0 rejected, 0 dropped; 800 sequences (0 truncated, 0 turns trained from their
    own rendering); 41,200 tokens, 6,100 trained (14.8%)
    template: tiny's chat template; answers end at '<|im_end|>' (generation_config.json's eos_token_id)
    tokenizer: Qwen2Tokenizer, tokenizer.ids_from=checked (its ids checked against the tokenizer.json it came ...)

and what the chat template does around an answer: the tokens answers end at (the model's stop tokens), the
template's kwargs and a generation prompt's prefill, and what a user should know of it (`note:` lines).
"""

from __future__ import annotations

import argparse
import logging
import sys
from itertools import groupby

GREEN, RESET = "\033[42;30m", "\033[0m"


def stretches(tokenizer, input_ids: list[int], weights: list[float]) -> list[tuple[str, float]]:
    """The sequence as decoded stretches of consecutive tokens of one weight (0: not trained).

        [5, 6, 7, 8] with weights [0, 0, 1.5, 1.5]  ->  [("<|im_start|>user", 0.0), ("4<|im_end|>", 1.5)]
    """
    out, i = [], 0
    for weight, group in groupby(weights):
        n = len(list(group))
        out.append((tokenizer.decode(input_ids[i:i + n], skip_special_tokens=False), weight))
        i += n
    return out


def show(tokenizer, row: dict, file: str, color: bool) -> str:
    """One sequence as the model reads it, its trained stretches marked with their weight."""
    from sft.data.tokens.collator import WeightedDataCollator

    weights = WeightedDataCollator(tokenizer)([row])["weights"][0]  # exactly what the trainer gets
    trained = int((weights > 0).sum())
    view = f" (turn trained from its own rendering, {row['view']})" if row.get("view") else ""
    header = (f"-- {file}:{row['source_line']}{view} · {len(row['input_ids'])} tokens, {trained} trained · "
              f"sample weight {row['sample_weight']:g}")
    body = []
    for text, weight in stretches(tokenizer, row["input_ids"], weights.tolist()):
        if weight == 0:
            body.append(text)
        elif color:
            body.append(f"{GREEN}{text}{RESET}×{weight:g}")
        else:
            body.append(f"⟦{text}⟧×{weight:g}")
    return header + "\n" + "".join(body).rstrip("\n")


def totals(split: str, summary) -> str:
    """A split's counts (`sft.data.splits.preprocess.SplitSummary`) in one paragraph."""
    share = 100 * summary.trained_tokens / max(summary.tokens, 1)
    reweighted = (f", {summary.reweighted_tokens:,} of them reweighted by the loss's token weights"
                  if summary.reweighted_tokens else "")
    return (f"{split}: {summary.rows:,} rows read, {summary.rejected:,} rejected, {summary.dropped:,} dropped; "
            f"{summary.sequences:,} sequences ({summary.truncated:,} truncated, {summary.own_turn_texts:,} turns "
            f"trained from their own rendering); {summary.tokens:,} tokens, {summary.trained_tokens:,} trained "
            f"({share:.1f}%){reweighted}")


def inspect(overrides: list[str], rows: int = 3, split: str = "train", color: bool = False) -> str:
    """The report for a config given as `sft.train` overrides (see the module docstring)."""
    from hydra.utils import instantiate

    from sft.config.registry import compose
    from sft.config.schema import ConfigError
    from sft.config.validate import check
    from sft.data.load import load_sft_datasets
    from sft.data.rows.reading import DataError
    from sft.loss.base import build_loss
    from sft.training.arguments import has_eval_data

    cfg = compose("train", overrides)
    check(cfg)
    if split == "eval" and not has_eval_data(cfg.data):
        raise ConfigError("data.eval_file", None, "no eval file to inspect (--split eval)")
    tokenizer = instantiate(cfg.tokenizer)
    spec, loss, refusal = instantiate(cfg.data, _convert_="object"), build_loss(cfg.loss), ""
    try:
        data = load_sft_datasets(spec, tokenizer, loss)
    except DataError as e:
        if not loss.reads_difficulty_score or "difficulty_score" not in str(e):
            raise
        # the rows as they are (each weighted 1), and what training with this loss will refuse
        data = load_sft_datasets(spec, tokenizer, None)
        refusal = (f"\nnote: loss={type(loss).__name__} reads each row's difficulty_score, so training will refuse "
                   f"rows of this data: {' '.join(line.strip() for line in str(e).strip().splitlines()[:2])}")
    scores = None  # the excess losses a loss's static weights come from (loss=reference_weighted)
    if loss.scores_before_training and refusal == "":  # its weights from a second model: scored (or cached) as a run's
        data, scores = reference_weights(cfg, data, loss, tokenizer)
    dataset = data.train if split == "train" else data.eval
    if split == "train" and spec.streaming:  # a stream's first sequences; its totals are not known before training
        from itertools import islice

        firsts = list(islice(dataset, rows))
        counted = "train: streamed (data.streaming=true): its rows are read, and counted, as they train"
    else:
        firsts = [dataset[i] for i in range(min(rows, len(dataset)))]
        counted = totals(split, data.summary[split])
        if scores is not None and split == "train":
            counted += f"\n{loss.describe_weights(scores)}"
    shown = [show(tokenizer, row, data.source_name(split, row.get("source", 0)), color) for row in firsts]
    ids = (f"tokenizer: {type(tokenizer).__name__}, tokenizer.ids_from={cfg.tokenizer.ids_from} (its ids checked against "
           "the tokenizer.json it came from: sft.model.tokenizer_ids)")
    return "\n\n".join(shown + [counted + refusal, template(tokenizer, cfg.data.prefill) + "\n" + ids]) + "\n"


def reference_weights(cfg, data, loss, tokenizer):
    """The data with the token weights a run of `loss=reference_weighted` would train with, and the excess losses they
    come from: from the cache, or scored now by the model as it starts (built as a run builds it, seeded alike) and the
    reference."""
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.model.reference_scores import weigh_by_reference

    def the_model():
        set_seed(cfg.trainer.seed)
        return instantiate(cfg.model)

    return weigh_by_reference(data, loss, the_model, cfg.model, cfg[loss.second_model], tokenizer, False,
                              cfg.trainer.seed)


def template(tokenizer, prefill: str) -> str:
    """What the chat template does around an answer (`sft.data.chat.template.TemplateProfile`), in one paragraph."""
    from sft.data.chat.settings import chat_settings
    from sft.data.chat.template import ChatRenderer

    settings, profile = chat_settings(tokenizer), ChatRenderer(tokenizer).profile
    own = ", and the template's own end of turn" if profile.end_of_turn else ""
    stops = ", ".join(map(repr, profile.stops)) or "no token"
    parts = [f"template: {settings.template_name}; answers end at {stops} ({settings.stops_from}{own})"]
    if settings.kwargs:
        from sft.config.secrets import masked

        parts.append(f"rendered with {', '.join(f'{k}={v!r}' for k, v in masked(settings.kwargs).items())}")
    if profile.prefill:
        parts.append(f"its generation prompt prefills {profile.prefill!r} (data.prefill={prefill})")
    return "; ".join(parts) + "".join(f"\nnote: {note}" for note in profile.notes)


def main(argv: list[str] | None = None) -> None:
    from sft.commands.train import fail_on_refusal

    parser = argparse.ArgumentParser(prog="sft inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3, help="sequences to show (default 3)")
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("overrides", nargs="*", help="sft.train's overrides, e.g. data.train_file=my.jsonl")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the slow work of a model's first use (a GGUF file assembled and converted, once) says what it is doing
    logging.getLogger("sft.model.gguf").setLevel(logging.INFO)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    try:
        report = inspect(args.overrides, args.rows, args.split, color)
    except Exception as e:
        fail_on_refusal(e, args.overrides)
        raise
    sys.stdout.write(report)


if __name__ == "__main__":
    main()
