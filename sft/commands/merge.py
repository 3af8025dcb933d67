"""`sft merge checkpoint=<run dir or checkpoint dir> output=<dir> [base=...] [gguf_file=...] [dtype=...]`: a LoRA adapter
merged into its base model (`sft.model.merge`), saved as a model any server that loads Hugging Face checkpoints loads."""

from __future__ import annotations

import sys

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from sft.model.merge import MergeConfig, MergeError, merge


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(MergeConfig), OmegaConf.from_dotlist(argv))
        out = merge(cfg.checkpoint, cfg.output, cfg.base, cfg.dtype, cfg.gguf_file)
    except (MergeError, OmegaConfBaseException) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        print("usage: sft merge checkpoint=<run dir or checkpoint dir> output=<dir> [base=...] [gguf_file=...] "
              "[dtype=...]",
              file=sys.stderr)
        sys.exit(2)
    print(f"merged model: {out}")



if __name__ == "__main__":
    main()
