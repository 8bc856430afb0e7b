"""The package's layers import downward only (issue 54): the order is written once, here, and
every module of ringreduce is checked against it, with no import circles and no imports of
ours hidden inside functions; a planted upward import fails the check."""
import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ringreduce"

# Lowest first. A module may import its own layer and the layers below it. Subpackages of one
# rank share a layer (the host and device kernels); the modules at the package's top level
# (checkpoint, lightning, run, runner, torch) are front doors, beside `distributed` and
# `elastic`; the package's own __init__ stands above everything it exports.
LAYERS = [
    {"core"},
    {"kernels", "gpu"},
    {"transport"},
    {"sets"},
    {"api"},
    {"optim"},
    {"distributed", "elastic", "front door"},
    {"ringreduce", "torch"},      # (torch: the whole package again, as horovod.torch)
]


def _module(path: Path, root: Path) -> str:
    """'transport.ring', 'distributed' (a package's __init__), 'checkpoint', or '' for the
    package's own __init__."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    name = ("ringreduce" if module == "" else top if any(top in layer for layer in LAYERS)
            else "front door")
    return next(rank for rank, layer in enumerate(LAYERS) if name in layer)


def _imports(tree: ast.Module, module: str, is_package: bool
             ) -> list[tuple[str, list[str], bool, int]]:
    """(imported module below ringreduce, the names taken from it, at the module's top level,
    line) for every import of ours."""
    here = module.split(".") if module else []
    package = here if is_package else here[:-1]
    found = []
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "ringreduce":
                target = node.module.partition(".")[2]
            else:
                continue
            found.append((target, names, id(node) in top_level, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name.partition(".")[2], [], id(node) in top_level, node.lineno)
                      for a in node.names if a.name.split(".")[0] == "ringreduce"]
    return found


def violations(root: Path = PACKAGE) -> list[str]:
    """Every upward import, hidden import and import circle among the modules under `root`."""
    problems, graph = [], {}
    modules = {_module(p, root): p for p in root.rglob("*.py")}
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        edges = graph.setdefault(module, set())
        for base, names, at_top, line in _imports(tree, module, path.name == "__init__.py"):
            submodules = [f"{base}.{n}".lstrip(".") for n in names
                          if f"{base}.{n}".lstrip(".") in modules or n == "_native"]
            for target in submodules or [base]:
                where = f"{path.relative_to(root.parent)}:{line}"
                if not at_top:
                    problems.append(f"{where}: imports ringreduce.{target} inside a function")
                if target == "_native":     # (the C extension: the kernels' own)
                    if layer_of(module) < layer_of("kernels"):
                        problems.append(f"{where}: imports ringreduce._native below the kernels")
                    continue
                if layer_of(target) > layer_of(module):
                    problems.append(f"{where}: {module or 'ringreduce'} (layer "
                                    f"{layer_of(module)}) imports {target} (layer "
                                    f"{layer_of(target)}), a higher layer")
                if target != module and target in modules:
                    edges.add(target)
    problems += [f"import circle: {' -> '.join(c)}" for c in _circles(graph)]
    return problems


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_layers_import_downward_only():
    assert violations() == []


def test_every_subpackage_has_a_layer_and_says_what_it_owns():
    for init in PACKAGE.glob("*/__init__.py"):
        name = init.parent.name
        assert any(name in layer for layer in LAYERS), f"{name} has no layer in LAYERS"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_a_planted_upward_import_fails(tmp_path):
    copy = tmp_path / "ringreduce"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    errors = copy / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom ..api import collectives  # planted\n")
    found = violations(copy)
    assert "core.errors (layer 0) imports api.collectives (layer 4)" in found[0], found
    assert all("core.errors" in v for v in found), found     # (and the circle it closes)
    hidden = copy / "kernels" / "ops.py"
    hidden.write_text(hidden.read_text() + "\n\ndef f():\n    from ..core import config\n")
    assert any("inside a function" in v for v in violations(copy))
