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
# `version()`), the file writes every stage makes (`sft.files`), which process this is (`sft.ranks`) and where built
# artefacts are cached (`sft.cache`) are at the base. The data and training stages are rooms: sub-packages of one
# concept each, ordered as the stages are, each saying in its `__init__` what it may import (`may_import`).
STAGES = [
    ("config base", ("sft", "sft.config.schema", "sft.config.validate", "sft.config.secrets", "sft.config.overrides",
                     "sft.sample_data", "sft.files", "sft.ranks", "sft.cache")),
    # the data stage's rooms (sft/data/__init__.py), lowest first; its loader on top
    ("data: rows", ("sft.data.rows",)),
    ("data: its config", ("sft.data.spec",)),
    ("data: chat", ("sft.data.chat",)),
    ("data: tokens", ("sft.data.tokens",)),
    ("data: splits", ("sft.data.splits",)),
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
ROOMED = ("data", "training")  # the stages made of rooms
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


def may_import(package: str) -> list[str]:
    """What a room's `__init__` says it may import: the backquoted items of its "May import:" line, each a stage's
    name (`config base`) or a module prefix (`sft.data.spec`)."""
    import re

    doc = ast.get_docstring(ast.parse((PACKAGE.parent / package.replace(".", "/") / "__init__.py").read_text())) or ""
    line = doc[doc.index("May import:"):] if "May import:" in doc else ""
    return re.findall(r"`([^`]+)`", line)


def test_each_room_imports_only_what_its_init_says_it_may():
    """A room's "May import:" line is the truth: every sft module a room's modules import is the room's own or one the
    line names, and the line names only what is below the room (it cannot allow an upward import)."""
    graph, names = imports(), [name for name, _ in STAGES]
    rooms = sorted(prefix for _, prefixes in STAGES for prefix in prefixes
                   if prefix.count(".") == 2 and prefix.split(".")[1] in ROOMED
                   and (PACKAGE / prefix.split(".")[1] / prefix.split(".")[2] / "__init__.py").is_file())
    assert len(rooms) >= 9, rooms  # data: 4, training: 5
    wrong = []
    for room in rooms:
        allowed = may_import(room)
        if not allowed:
            wrong.append(f"{room}: its __init__ has no \"May import:\" line")
            continue
        for item in allowed:
            below = (names.index(item) if item in names else stage(item)) < stage(room)
            if not below:
                wrong.append(f"{room}: May import names {item}, which is not below it")

        def permitted(dep):
            return any(stage(dep) == names.index(item) if item in names else dep == item or dep.startswith(item + ".")
                       for item in allowed)

        for module, deps in sorted(graph.items()):
            if module == room or module.startswith(room + "."):
                wrong += [f"{module} imports {dep}, which {room}'s May import line does not name"
                          for dep in sorted(deps) if not (dep == room or dep.startswith(room + ".")) and not permitted(dep)]
    assert not wrong, "\n".join(wrong)


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
    # the data and training stages are rooms: each sub-package is a stage of STAGES
    for stage_package in ROOMED:
        rooms = {p.name for p in (PACKAGE / stage_package).iterdir() if (p / "__init__.py").is_file()}
        assert rooms == {prefix.split(".")[2] for _, prefixes in STAGES for prefix in prefixes
                         if prefix.count(".") == 2 and prefix.startswith(f"sft.{stage_package}.")
                         and (PACKAGE / stage_package / prefix.split(".")[2]).is_dir()}, stage_package
    assert "commands" in packages
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "cache.py", "files.py", "ranks.py",
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


# A module without a test file of its own (`tests/<package>/test_<module>.py`), and the test file that covers it, with
# what in that file reaches it (an import, a command, a case): a run through the command line or the bench reaches
# several modules at once.
COVERED_BY = {
    "sft/bench/baseline.py": ("tests/data/tokens/test_labels.py", "from sft.bench import baseline"),
    "sft/bench/checkpoint_memory.py": ("tests/e2e/test_distributed.py", "sft.bench.checkpoint_memory"),
    "sft/bench/device.py": ("tests/bench/test_run.py", "sft.bench.device"),
    "sft/bench/long_rows.py": ("tests/bench/test_run.py", "bench.cases=[long_rows]"),
    "sft/bench/loss_cases.py": ("tests/bench/test_run.py", 'raw["loss_lean"]'),
    "sft/bench/matmul.py": ("tests/bench/test_run.py", "sft.bench.matmul"),
    "sft/bench/report.py": ("tests/bench/test_run.py", "print_report"),
    "sft/bench/startup.py": ("tests/bench/test_run.py", '"startup_first_step_s"'),
    "sft/commands/consolidate.py": ("tests/e2e/test_distributed.py", '"consolidate"'),
    "sft/commands/distill.py": ("tests/model/test_teacher_cache.py", 'sft("distill", "cache"'),
    "sft/commands/export.py": ("tests/model/test_gguf_export.py", '"sft", "export"'),
    "sft/commands/merge.py": ("tests/model/test_merge.py", '"sft", "merge"'),
    "sft/commands/report.py": ("tests/experiments/test_report.py", "sft.commands.report"),
    "sft/commands/sweep.py": ("tests/experiments/test_sweep.py", 'launch("--nproc", "2", "-m"'),
    "sft/config/schema.py": ("tests/config/test_help.py", "sft.config.schema"),
    "sft/data/spec.py": ("tests/data/test_load.py", "sft.data.spec"),
    "sft/data/splits/streaming.py": ("tests/e2e/test_streaming.py", "sft.data.splits.streaming"),
    "sft/data/tokens/weights.py": ("tests/loss/test_base.py", 'data.train["sample_weight"]'),
    "sft/eval/tasks/utils.py": ("tests/eval/test_harness.py", "sft_sample_addition"),
    "sft/experiments/stats.py": ("tests/experiments/test_report.py", "sft.experiments.stats"),
    "sft/experiments/tracking.py": ("tests/experiments/test_sweep.py", "trainer.report_to=[mlflow]"),
    "sft/experiments/verdict.py": ("tests/experiments/test_report.py", "sft.experiments.verdict"),
    "sft/model/liger.py": ("tests/training/test_arguments.py", "sft.model.liger"),
    "sft/run/build.py": ("tests/training/test_arguments.py", "sft.run.build"),
    "sft/run/finish.py": ("tests/commands/test_train.py", '"results.json"'),
    "sft/run/recipe.py": ("tests/commands/test_recipe.py", 'sft("recipe"'),
    "sft/run/teacher_cache.py": ("tests/model/test_teacher_cache.py", "from sft.commands.distill import cache"),
    "sft/run/train.py": ("tests/commands/test_train.py", "run_train("),
    "sft/train.py": ("tests/config/test_argv.py", "sft.train"),
    "sft/training/checkpoints/memory_peak.py": ("tests/e2e/test_distributed.py", "memory above the step's"),
    "sft/training/checkpoints/saving.py": ("tests/training/test_trainer.py", "_save_checkpoint"),
    "sft/training/evaluation.py": ("tests/training/test_trainer.py", "trainer.evaluate()"),
    "sft/training/observability/metrics_file.py": ("tests/training/observability/test_step_log.py", "metrics.jsonl"),
    "sft/training/observability/noise.py": ("tests/training/observability/test_step_log.py", "no noise"),
    "sft/training/processes/sentinel.py": ("tests/training/checkpoints/test_run_dir.py", "sentinel"),
    "sft/training/trainer_fields.py": ("tests/training/test_arguments.py", "trainer_fields"),
}


def own_test(path: Path) -> Path:
    """Where a module's own test file is: `tests/<its package>/test_<module>.py`."""
    relative = path.relative_to(PACKAGE)
    return TESTS / relative.parent / f"test_{relative.stem}.py"


def test_every_module_has_a_test_file_or_is_named_as_covered_by_one():
    """A module without a test file of its own is in COVERED_BY, and the test file named there reaches it as said;
    a module that has its own test file is not listed (the list shrinks as tests are written)."""
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    untested = [str(p.relative_to(REPO)) for p in modules if not own_test(p).is_file()]
    assert sorted(set(untested) - COVERED_BY.keys()) == [], "a module with no test file, and none named as covering it"
    assert sorted(COVERED_BY.keys() - set(untested)) == [], "listed as covered by another, but has its own test file"
    wrong = [f"{module}: {test} does not contain {evidence!r}" for module, (test, evidence) in COVERED_BY.items()
             if not (REPO / test).is_file() or evidence not in (REPO / test).read_text()]
    assert not wrong, "\n".join(wrong)


def architecture_map() -> dict[str, str]:
    """docs/architecture.md's module map: its table's rows `| sft/...py | what it holds |`."""
    import re

    text = (REPO / "docs" / "architecture.md").read_text().split("## The module map", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(sft/[\w/]+\.py)` \| (.+?) \|$", text, re.M))


def test_the_architecture_map_lists_every_module_and_no_other():
    """docs/architecture.md's module map names every module of the package (an `__init__` where it holds code) with
    what it holds; a module added, moved or removed without the map fails here."""
    modules = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" or len(ast.parse(p.read_text()).body) > 1}
    mapped = architecture_map()
    assert sorted(modules - mapped.keys()) == [], "modules the map leaves out"
    assert sorted(mapped.keys() - modules) == [], "rows of the map that name no module"
    assert all(len(what.strip()) > 10 for what in mapped.values()), "a row that does not say what its module holds"
