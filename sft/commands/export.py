"""`sft export gguf <run dir | checkpoint | model dir> [--outtype q8_0] [-o model.gguf] [--llama-cpp DIR] [--base M]`:
the model as one GGUF file for llama.cpp, Ollama and LM Studio, and an Ollama Modelfile beside it
(`sft.model.gguf_export`: llama.cpp's own converter and quantizer)."""

from __future__ import annotations

import argparse
import sys
import time

from sft.model.gguf_export import LLAMA_CPP_PYTHON, OUTTYPES, ExportError, export


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sft export", description="the model as one GGUF file for llama.cpp, "
                                     "Ollama and LM Studio, by llama.cpp's own converter and quantizer; an Ollama "
                                     "Modelfile beside it")
    parser.add_argument("format", choices=["gguf"], help="the file format (gguf: llama.cpp, Ollama, LM Studio)")
    parser.add_argument("source", help="a run dir, a checkpoint, or a merged or full model dir (a LoRA adapter is "
                        "merged into its base first)")
    parser.add_argument("--outtype", default="q8_0", choices=OUTTYPES,
                        help="f32, f16, bf16, q8_0: llama.cpp's converter; the others (q4_k_m, ...): its quantizer, "
                        f"through llama-cpp-python=={LLAMA_CPP_PYTHON}, installed the first time (it builds llama.cpp: "
                        "about 5 minutes on 2 cores)")
    parser.add_argument("-o", "--output", help="the file (default: <source>/model-<outtype>.gguf)")
    parser.add_argument("--llama-cpp", help="a llama.cpp checkout whose convert_hf_to_gguf.py to use (default: the "
                        f"one of llama-cpp-python {LLAMA_CPP_PYTHON}'s source, fetched once into the sft cache)")
    parser.add_argument("--base", help="the base model of a LoRA adapter (default: the run's model)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    try:
        out = export(args.source, args.output or f"{args.source.rstrip('/')}/model-{args.outtype}.gguf",
                     args.outtype, args.llama_cpp, args.base)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    size = out.stat().st_size / 2**20
    print(f"gguf: {out} ({args.outtype}, {size:,.0f} MiB, {time.monotonic() - started:.0f} s)\n"
          f"ollama: ollama create <name> -f {out.parent / 'Modelfile'}\n"
          f"llama.cpp: llama-cli -m {out} -cnv")


if __name__ == "__main__":
    main()
