"""`sft <command> [arguments]`: the console command, one name for each tool of `python -m sft.<module>`.

    sft train [overrides]            fine-tune (Hydra overrides; -m: a sweep in this process)   python -m sft.train
    sft inspect [--rows N] [...]      what will be trained, as the chat template renders it     python -m sft.inspect_data
    ...

`sft --help` lists them; `sft <command> --help` is the command's own help. launch.sh stays the way to start several
processes (accelerate launch) and to set up the environment.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it does); each module has main(argv), but sft.train, whose entry point is cli()
COMMANDS = {
    "train": ("sft.train", "fine-tune: Hydra overrides (sft train model=smollm2_135m lora=default); -m: a sweep"),
    "inspect": ("sft.inspect_data", "show what will be trained, as the model's chat template renders it"),
    "merge": ("sft.merge", "merge a LoRA adapter into its base model, for serving"),
    "compare": ("sft.compare", "the base and the trained model's greedy answers side by side"),
    "recipe": ("sft.recipe", "a run as a recipe file: sft train --config-dir <dir> --config-name <recipe>"),
    "report": ("sft.report", "rebuild a sweep's report (verdict, intervals, paired differences)"),
    "sweep": ("sft.sweep", "a sweep, each job through accelerate launch (what ./launch.sh -m runs)"),
    "bench": ("sft.bench", "speed and memory, side by side: sft against a raw loop, Trainer, TRL"),
    "gpu-pack": ("sft.gpu_pack", "the GPU tests and the GPU bench, their figures into README.md"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: sft <command> [arguments]   (sft <command> --help: the command's own help)", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"error: sft has no command {name!r}\n{usage()}")
        sys.exit(2)
    module = importlib.import_module(COMMANDS[name][0] if name != "bench" else "sft.bench.run")
    if name == "train":
        sys.argv = ["sft train", *rest]  # Hydra reads sys.argv
        module.cli()
        from sft.training.distributed import exit_without_teardown

        exit_without_teardown()
    code = module.main(rest)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
