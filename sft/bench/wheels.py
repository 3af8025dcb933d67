"""What the GPU pack needs on a machine without a package index, and the wheels that carry it there.

The lent GPU machine runs a fixed image (Python 3.12, a CUDA build of torch, transformers and some of the stack) and
reaches no index, so what the pack imports and the image lacks, or has at another version, travels as wheels:

    sft gpu-pack --wheels .whl      the wheels of exactly what the image lacks, at this checkout's versions, for
                                    CPython 3.12 on x86-64 Linux (a wheel built here where only a source
                                    distribution exists: antlr4 4.9.3), their size said; `.whl/pins.txt` beside them
    sft gpu-pack --check            on the machine: each installed version against the pins, a mismatch named

What the pack needs is its own requirements (`PACK_REQUIREMENTS`) and everything they need, read from their installed
metadata here as pip would install them for the target, each with the specifiers its requirers put on it. What is
carried is what the image (`IMAGE`: the device tool's KINDS.md, read 2026-11-17) lacks or has at a version a requirer
does not take, at the version this checkout is tested with (the one installed here); what the image has and every
requirer takes stays as it is there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

# what the pack imports (the bench's cases, the GPU tests), by distribution: sft's runtime requirements that the
# bench and trainer use, TRL for the bench's TRL cases, pytest for the GPU tests; the kernels' (pure Python, on
# Triton) where this checkout pins them
PACK_REQUIREMENTS = ("transformers", "peft", "accelerate", "datasets", "hydra-core", "omegaconf", "pyyaml", "numpy",
                     "filelock", "typing-extensions", "trl", "pytest")
OPTIONAL = {"liger-kernel": ">=0.8.2", "cut-cross-entropy": ">=25.1"}  # pyproject's `gpu` extra: no pin, the newest
NEVER_CARRIED = {"torch", "triton"}  # the image's CUDA build: a wheel from here would replace it with another

# The image's Python packages (the device tool's KINDS.md, read 2026-11-17), with the versions read there; None:
# there, version not read (`--check` on the machine reads it).
IMAGE = dict.fromkeys("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython diffrax einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numpy numpyro onnx opencv-python-headless optax opt-einsum
optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pytest pytest-timeout
python-dateutil pyyaml regex requests rich safetensors scikit-learn scipy seaborn sentencepiece setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorstore threadpoolctl tiktoken
timm tokenizers toolz torch tqdm transformers triton typer typing-extensions typing-inspect urllib3 wheel wrapt xarray
xxhash yarl zipp""".split())
IMAGE.update({"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
              "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"})
# versions not read, but seen to be below these (issue 69: datasets 5.2's pyarrow>=24 and transformers 5.24's
# regex>=2025.10.22 did not hold there)
IMAGE_BELOW = {"pyarrow": "24.0.0", "regex": "2025.10.22"}
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
BUDGET_MIB = 48  # of the 64 MiB a device call carries, what the wheels may take beside the checkout


def canonical(name: str) -> str:
    """A distribution's name as indexes compare it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """A distribution the pack needs: its version (None: the newest that satisfies `spec`), who needs it, how."""

    name: str
    version: str | None
    spec: str = ""
    needed_by: tuple[str, ...] = ()


def root_specs() -> dict[str, str]:
    """The specifiers sft itself puts on the pack's requirements (pyproject's dependencies, its `bench` and `dev`
    extras: transformers' range, TRL's pin)."""
    from packaging.requirements import Requirement

    try:
        lines = distribution("sft").requires or []
    except PackageNotFoundError:  # a source tree that was not installed: no pins of sft's own to add
        lines = []
    wanted = {canonical(n) for n in PACK_REQUIREMENTS}
    specs: dict[str, list[str]] = {}
    for line in lines:
        requirement = Requirement(line)
        taken = requirement.marker is None or any(requirement.marker.evaluate({**TARGET, "extra": extra})
                                                  for extra in ("", "bench", "dev"))
        if taken and canonical(requirement.name) in wanted:
            specs.setdefault(canonical(requirement.name), []).append(str(requirement.specifier))
    return {name: ",".join(s for s in spec if s) for name, spec in specs.items()}


def plan(image: dict[str, str | None] = IMAGE, below: dict[str, str] = IMAGE_BELOW
         ) -> tuple[dict[str, Pin], list[Pin], list[str]]:
    """What the pack needs and what of it to carry: from its requirements down, each at the version installed here
    with its requirers' specifiers; a requirement the image meets is kept there (its own needs are the image's), one
    it lacks or has at a version a requirer does not take is carried, and what that one needs is looked at in turn.
    Returns (every pin, the pins to carry, why each is carried)."""
    from packaging.requirements import Requirement

    required: dict[str, Pin] = {}
    specs = {name: [spec] for name, spec in root_specs().items()}
    needed_by: dict[str, set[str]] = {canonical(name): {"sft"} for name in PACK_REQUIREMENTS}
    todo = [canonical(name) for name in PACK_REQUIREMENTS]
    carry, why, done = [], [], set()
    while todo:
        key = todo.pop(0)
        if key in done:
            continue
        done.add(key)
        try:
            dist = distribution(key)
        except PackageNotFoundError:
            continue  # not installed here: nothing to pin (the check names it where the pack imports it)
        pin = Pin(key, dist.version, ",".join(s for s in specs.get(key, []) if s), tuple(sorted(needed_by[key])))
        required[key] = pin
        reason = carry_reason(pin, image, below)
        if reason is None:
            continue
        carry.append(pin)
        why.append(f"{key}=={pin.version}: {reason}")
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
                continue
            other = canonical(requirement.name)
            specs.setdefault(other, []).append(str(requirement.specifier))
            needed_by.setdefault(other, set()).add(key)
            todo.append(other)
    for key, spec in OPTIONAL.items():  # the kernels: not installed here, the newest the extra takes
        pin = Pin(key, None, spec, ("sft[gpu]",))
        required[key] = pin
        if (reason := carry_reason(pin, image, below)) is not None:
            carry.append(pin)
            why.append(f"{key}{spec}: {reason}")
    return dict(sorted(required.items())), carry, why


def carry_reason(pin: Pin, image: dict[str, str | None], below: dict[str, str]) -> str | None:
    """Why `pin` must be carried to the image (it lacks it, or has it at a version a requirer does not take), or
    None where the image's does."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(pin.spec)
    if pin.name in NEVER_CARRIED:
        return None
    if pin.name not in image:
        return "not in the image"
    there = image[pin.name]
    if there is not None and not spec.contains(there, prereleases=True):
        return f"the image has {there}, and {', '.join(pin.needed_by)} need {pin.spec}"
    if there is None and pin.name in below and not spec.contains(f"{below[pin.name]}.dev0", prereleases=True):
        return f"the image's is below {below[pin.name]}, and {', '.join(pin.needed_by)} need {pin.spec}"
    return None


def gather(directory: Path, carry: list[Pin], pip: list[str] | None = None) -> list[Path]:
    """Each pin's wheel for CPython 3.12 on x86-64 Linux into `directory` (`pip download`, no dependencies: the list
    is whole), a wheel built here where the index has only a source distribution; the wheels' paths."""
    pip = pip or [sys.executable, "-m", "pip"]
    directory.mkdir(parents=True, exist_ok=True)
    for pin in carry:
        wanted = f"{pin.name}=={pin.version}" if pin.version else f"{pin.name}{pin.spec}"
        binary = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                  "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
                  *[arg for platform in PLATFORMS for arg in ("--platform", platform)], "--platform", "any",
                  "-d", str(directory), "-q", wanted]
        if subprocess.run(binary, capture_output=True, text=True).returncode == 0:
            continue
        built = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(directory), "-q", wanted], capture_output=True,
                               text=True)  # a source distribution only (antlr4 4.9.3): a pure-Python wheel
        if built.returncode != 0:
            raise RuntimeError(f"no wheel of {wanted} for CPython 3.12 on Linux, and none could be built here: "
                               f"{(built.stderr or built.stdout).strip().splitlines()[-1:]}")
    return sorted(directory.glob("*.whl"))


def write_pins(directory: Path, required: dict[str, Pin], carried: list[Pin]) -> Path:
    """`pins.txt` beside the wheels, which `sft gpu-pack --check` compares with what is installed on the machine: a
    carried distribution at its version (`name==version`), one the image has with its requirers' specifiers; the
    optional kernels as comments (a machine without them runs the pack, their cases and tests skipped)."""
    exact = {pin.name for pin in carried if pin.version}
    lines = []
    for pin in required.values():
        if pin.name in NEVER_CARRIED:
            continue
        line = f"{pin.name}=={pin.version}" if pin.name in exact else f"{pin.name}{pin.spec}"
        lines.append(f"# optional: {line}" if pin.name in OPTIONAL else line)
    path = directory / "pins.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_pins(path: Path) -> dict[str, str]:
    """`pins.txt`'s lines as {name: specifier} (the optional ones, comments, left out)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", line.strip()).groups()
            out[canonical(name)] = spec
    return out


def mismatches(wanted: dict[str, str]) -> list[str]:
    """One line for each pin the installed packages do not satisfy: missing, or at another version."""
    from packaging.specifiers import SpecifierSet

    lines = []
    for name, spec in sorted(wanted.items()):
        try:
            installed = distribution(name).version
        except PackageNotFoundError:
            lines.append(f"{name}: not installed (wanted {spec or 'any'})")
            continue
        if spec and not SpecifierSet(spec).contains(installed, prereleases=True):
            lines.append(f"{name}: {installed} installed, wanted {spec}")
    return lines


def install_line(directory: str = ".whl") -> str:
    """The line that installs carried wheels on the machine, before the pack (the device tool's README)."""
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {directory}/*.whl "
            "&& export PYTHONPATH=/tmp/site")
