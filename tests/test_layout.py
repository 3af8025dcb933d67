"""The package's shape: its import graph has no circle and no upward edge between the stages, the composition of
the config imports neither torch nor transformers, every module stays readable (about 500 lines at most), and the
tests mirror the package."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "sft"
TESTS = REPO / "tests"

# The stages, lowest first: a module imports modules of its own stage or of a lower one, never of a higher one.
# The config's base (schemas, validation) is below every stage; its composition (the registry that gathers every
# stage's schemas, --help, the command-line checks) above them; a training run (`sft.run`: build, train, finish)
# above that, then the bench, which times what a run builds; the commands (`sft.commands`, one module per command,
# and the top-level entry points `python -m sft` and `python -m sft.train`) on top. The package's root (`sft`:
# `version()`), the file writes every stage makes (`sft.files`) and which process this is (`sft.ranks`) are at the base.
STAGES = [
    ("config base", ("sft", "sft.config.schema", "sft.config.validate", "sft.config.secrets", "sft.sample_data",
                     "sft.files", "sft.ranks")),
    ("data", ("sft.data",)),
    ("loss", ("sft.loss",)),
    ("model", ("sft.model",)),
    ("eval", ("sft.eval",)),
    # the training stage's rooms (sft/training/__init__.py), lowest first; its trainer and arguments on top
    ("training base", ("sft.training.compat", "sft.training.callbacks")),
    ("training: processes", ("sft.training.processes",)),
    ("training: checkpoints", ("sft.training.checkpoints",)),
    ("training: observability", ("sft.training.observability",)),
    ("training: controllers", ("sft.training.controllers",)),
    ("training: a step's control", ("sft.training.step",)),
    ("training", ("sft.training",)),
    ("experiments", ("sft.experiments",)),
    ("config composition", ("sft.config",)),
    ("run", ("sft.run",)),
    ("bench", ("sft.bench",)),
    ("commands", ("sft.commands", "sft.train", "sft.__main__")),
]
LONGEST = 500  # lines
GENERATED = {"sft/training/trainer_fields.py"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """sft module -> the sft modules it imports, at module level or inside a function."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sft"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("sft")}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def stage(module: str) -> int:
    """The index in STAGES of a module's stage: that of its longest matching prefix."""
    matches = [(len(prefix), i) for i, (_, prefixes) in enumerate(STAGES) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


def test_the_module_graph_has_no_circle():
    graph, done, path = imports(), set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_no_stage_imports_a_later_one():
    upward = [f"{m} ({STAGES[stage(m)][0]}) imports {d} ({STAGES[stage(d)][0]})"
              for m, deps in sorted(imports().items()) for d in sorted(deps) if stage(d) > stage(m)]
    assert not upward, "\n".join(upward)
    graph = imports()
    # the rules the stages are for, spelled out
    assert not any(d.startswith(("sft.loss", "sft.training")) for m, deps in graph.items() if m.startswith("sft.data")
                   for d in deps)
    assert not any(d.startswith("sft.training") for m, deps in graph.items() if m.startswith("sft.loss") for d in deps)
    # the config's base imports nothing of sft but itself
    assert all(d.startswith("sft.config.") for m in ("sft.config.schema", "sft.config.validate") for d in graph[m])


def test_composing_the_config_imports_neither_torch_nor_transformers():
    script = ("import sys; from sft.config import compose, check; compose('train', ['+controllers=curriculum']); "
              "check(compose('train', ['loss=keywords', 'loss.phrases=[a]', 'clip=zclip', 'lora=default'])); "
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_entry_points_import_neither_torch_nor_transformers():
    """`--help` and `--cfg job` take half a second: nothing heavy at the import of a command or of the run (a
    callback module imported at the top of sft.run.train once made both 3.4 s)."""
    script = ("import sys, sft.commands, sft.commands.train, sft.run.train, sft.commands.plot, sft.commands.report; "
              "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_is_much_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST and str(p.relative_to(REPO)) not in GENERATED}
    assert not long, long


def test_the_top_reads_as_the_stages_plus_the_commands():
    """The package's top holds its stages' packages (each in STAGES), the commands' package and the entry points,
    nothing else; every command of `sft` is a module of `sft.commands` (the bench, a package of its own, aside)."""
    from sft.commands import COMMANDS

    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {prefix.split(".")[1] for _, prefixes in STAGES for prefix in prefixes
                        if prefix.count(".") == 1 and (PACKAGE / prefix.split(".")[1]).is_dir()}
    # the training stage is rooms: each sub-package is a stage of STAGES, and its __init__ says what it may import
    rooms = {p.name for p in (PACKAGE / "training").iterdir() if (p / "__init__.py").is_file()}
    assert rooms == {prefix.split(".")[2] for _, prefixes in STAGES for prefix in prefixes
                     if prefix.count(".") == 2 and prefix.startswith("sft.training.")
                     and (PACKAGE / "training" / prefix.split(".")[2]).is_dir()}
    for room in rooms:
        assert "May import:" in (PACKAGE / "training" / room / "__init__.py").read_text(), room
    assert "commands" in packages
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "files.py", "ranks.py",
                                                                  "train.py"]
    assert {module for module, _ in COMMANDS.values()} - {"sft.bench.run"} == {
        module_name(p) for p in (PACKAGE / "commands").glob("*.py") if p.name != "__init__.py"}


def test_the_tests_mirror_the_package():
    """`tests/<package>/test_<module>.py` tests `sft/<package>/<module>.py`; end-to-end runs are in `tests/e2e/`;
    the commands' tests in `tests/` itself (`test_train.py` for `sft/train.py`)."""
    stray = []
    for test in TESTS.rglob("test_*.py"):
        folder = test.parent.relative_to(TESTS)
        if folder.parts[:1] == ("e2e",):
            continue
        module = test.stem.removeprefix("test_")
        target = PACKAGE / folder / f"{module}.py"
        if not (target.is_file() or (PACKAGE / folder / module).is_dir()) and test.name not in MIRROR_EXCEPTIONS:
            stray.append(str(test.relative_to(REPO)))
    assert not stray, f"tests named after no module: {stray}"


# tests of the package as a whole, not of one module
MIRROR_EXCEPTIONS = {"test_layout.py", "test_docs.py", "test_real_templates.py"}
