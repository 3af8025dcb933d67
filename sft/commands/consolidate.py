"""`sft consolidate <checkpoint> <out> [--max-file-gb N]`: a sharded checkpoint (FSDP2's, every rank's DCP shards) as
a model dir that transformers, vLLM, `sft merge`/`sft export` and every server load: safetensors, config, tokenizer.

One process on any machine (no GPU, no process group), memory near one output file (`sft.model.consolidate`):

    sft consolidate outputs/run/checkpoint-800 outputs/run/model-800
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sft consolidate", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint dir with pytorch_model_fsdp_0/ (checkpoint.format=sharded)")
    p.add_argument("out", help="the model dir to write")
    p.add_argument("--max-file-gb", type=float, default=5.0, help="the largest safetensors file (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    from sft.model.consolidate import ConsolidateError, consolidate
    from sft.training.checkpoints.sharded import MODEL_DIR, sharded_checkpoint

    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    checkpoint = Path(args.checkpoint)
    if not sharded_checkpoint(checkpoint):
        print(f"error: {checkpoint}: no sharded model ({MODEL_DIR}/.metadata): not a sharded checkpoint (a gathered "
              "one holds model.safetensors, loadable as it is)", file=sys.stderr)
        return 2
    try:
        files = consolidate(checkpoint / MODEL_DIR, args.out, checkpoint, int(args.max_file_gb * 2**30))
    except (ConsolidateError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"model: {args.out} ({len(files)} safetensors file(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
