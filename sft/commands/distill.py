"""`sft distill cache [overrides]`: the teacher's top-k logits over a run's data, written once to the dir
`loss.teacher_cache`, for runs that then train from it without holding the teacher (`sft.model.teacher_cache`).

    sft distill cache loss=distill +teacher=path teacher.name_or_path=<its dir> loss.teacher_cache=<dir> \\
        [loss.top_k=64] [the run's data and model overrides]
    sft train loss=distill loss.teacher_cache=<dir> [the same data and model overrides]   (a sweep: -m)

The overrides are the run's: the data (rows, template, tokenizer, max_length) must be the run's, which its hash
checks; the teacher runs on the GPU where there is one, in its `teacher.dtype`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

log = logging.getLogger("sft")


def cache(overrides: list[str], device: str | None = None) -> str:
    """Write the cache a config given as `sft train` overrides names (`loss.teacher_cache`); what was written, in one
    line."""
    from sft.config.registry import compose
    from sft.config.validate import check
    from sft.run.teacher_cache import write_teacher_cache

    cfg = compose("train", overrides)
    check(cfg)
    started = time.perf_counter()
    meta = write_teacher_cache(cfg, device)
    path, tokens = cfg.loss.teacher_cache, sum(meta.tokens.values())
    kept = "".join(f"\n  {split}: the top {meta.top_k} hold {mass['mean']:.1%} of the teacher's probability a token "
                   f"on average (5% of the tokens: under {mass['p5']:.1%})" for split, mass in meta.kept_mass.items())
    return (f"{path}: the top {meta.top_k} logits of {cfg.teacher.name_or_path} at "
            f"{', '.join(f'{n:,} {split}' for split, n in meta.tokens.items())} tokens "
            f"({tokens * meta.top_k * 8 / 2 ** 20:.1f} MiB, {time.perf_counter() - started:.0f} s); train from it: "
            f"sft train loss=distill loss.teacher_cache={path} with the same data{kept}\n")


def main(argv: list[str] | None = None) -> None:
    from sft.commands.train import fail_on_refusal

    parser = argparse.ArgumentParser(prog="sft distill", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("cache",), help="cache: write the teacher's top-k logits")
    parser.add_argument("--device", default=None, help="where the teacher runs (default: cuda if there is one)")
    parser.add_argument("overrides", nargs="*", help="sft train's overrides, with +teacher and loss.teacher_cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        said = cache(args.overrides, args.device)
    except Exception as e:
        fail_on_refusal(e, args.overrides)
        raise
    sys.stdout.write(said)


if __name__ == "__main__":
    main()
