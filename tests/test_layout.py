"""The package's shape: its import graph has no circle, and the config layer imports no torch."""

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "sft"


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
    # The config layer stands alone: the bundled data's paths, the generated TrainingArguments fields, the
    # names of the row formats and the kinds of source, none of which imports anything of sft.
    leaves = {"sft.sample_data", "sft.config.trainer_fields", "sft.data.formats", "sft.data.sources"}
    assert "sft.config" not in graph["sft.data.batch"] and not graph["sft.config"] - leaves
    assert not graph["sft.config.trainer_fields"] and not graph["sft.data.formats"] and not graph["sft.data.sources"]


def test_composing_the_config_imports_neither_torch_nor_transformers():
    script = ("import sys; from sft.config import compose, check; compose('train', ['+controllers=curriculum']); "
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
