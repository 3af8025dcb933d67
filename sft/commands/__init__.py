"""The commands: `sft <command> [arguments]` (the console script; `python -m sft <command>` too), one module of this
package per command, each thin: it parses its arguments, calls the stage that does the work, and prints.

    sft train [overrides]            fine-tune (Hydra overrides; -m: a sweep in this process)   sft.commands.train
    sft inspect [--rows N] [...]      what will be trained, as the chat template renders it     sft.commands.inspect
    ...

`sft --help` lists them, `sft --version` says which sft this is; `sft <command> --help` is the command's own help.
`python -m sft.train` stays the training command's other name. launch.sh stays the way to start several processes
(accelerate launch) and to set up the environment.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# name -> (module, what it does); each module has main(argv), but train's, whose entry point is cli() (Hydra's)
COMMANDS = {
    "train": ("sft.commands.train", "fine-tune: Hydra overrides (sft train model=smollm2_135m lora=default); -m: a "
                                    "sweep"),
    "inspect": ("sft.commands.inspect", "show what will be trained, as the model's chat template renders it"),
    "distill": ("sft.commands.distill", "sft distill cache: a teacher's top-k logits over a run's data, written once "
                                        "for loss=distill loss.teacher_cache=<dir>"),
    "merge": ("sft.commands.merge", "merge a LoRA adapter into its base model, for serving"),
    "consolidate": ("sft.commands.consolidate", "a sharded checkpoint (FSDP2) as a model dir: safetensors, config, "
                                                "tokenizer; one process, no GPU"),
    "export": ("sft.commands.export", "the model as one GGUF file (llama.cpp, Ollama, LM Studio): sft export gguf "
                                      "<run dir> --outtype q4_k_m"),
    "compare": ("sft.commands.compare", "the base and the trained model's greedy answers side by side"),
    "recipe": ("sft.commands.recipe", "a run as a recipe file: sft train --config-dir <dir> --config-name <recipe>"),
    "plot": ("sft.commands.plot", "runs as one picture: loss, eval loss, learning rate, grad norm, buckets"),
    "report": ("sft.commands.report", "rebuild a sweep's report (verdict, intervals, paired differences); --html: a "
               "run's or sweep's page"),
    "board": ("sft.commands.board", "serve the pages of every run and sweep under some dirs on localhost"),
    "sweep": ("sft.commands.sweep", "a sweep, each job through accelerate launch (what ./launch.sh -m runs)"),
    "launch": ("sft.commands.launch", "several processes: accelerate launch, a refusal of the ranks said once (what "
                                      "./launch.sh --nproc N runs)"),
    "bench": ("sft.bench.run", "speed and memory, side by side: sft against a raw loop, Trainer, TRL"),
    "gpu-pack": ("sft.commands.gpu_pack", "the GPU tests and the GPU bench, their figures into README.md"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: sft <command> [arguments]   (sft <command> --help: the command's own help; sft --version)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return
    if argv[0] in ("-V", "--version"):
        from sft import version

        print(f"sft {version()} ({Path(__file__).resolve().parents[1]})")
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"error: sft has no command {name!r}\n{usage()}")
        sys.exit(2)
    if name == "train":
        from sft.training.processes.slurm import note_signals_from_the_start

        note_signals_from_the_start(rest)  # before the stack's imports: a SLURM signal then is not fatal
    module = importlib.import_module(COMMANDS[name][0])
    if name == "train":
        sys.argv = ["sft train", *rest]  # Hydra reads sys.argv
        module.cli()
        from sft.training.processes.distributed import exit_without_teardown

        exit_without_teardown()
    code = module.main(rest)
    sys.exit(code if isinstance(code, int) else 0)

