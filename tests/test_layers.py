"""The library's layers (persistentkv/__init__.py): every import, function-local ones included,
runs down the layers, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import persistentkv

PACKAGE = Path(persistentkv.__file__).resolve().parent
#: Files whose imports are brought onto the table with the kernel cut (engine, plan and their new
#: neighbours), with why each is skipped; the table already gives them their layers.
OWNED_ELSEWHERE: dict[str, str] = {}
_ROW = re.compile(r"^ +(\d+)  +([a-z0-9_ ]+?) +-- ")


def layers_table() -> dict[str, int]:
    """{module or package name under persistentkv: layer} from the package docstring's table."""
    layers = {}
    for line in (persistentkv.__doc__ or "").splitlines():
        row = _ROW.match(line)
        if row:
            for name in row.group(2).split():
                assert name not in layers, f"{name} is on two layers"
                layers[name] = int(row.group(1))
    return layers


LAYERS = layers_table()


def module_name(path: Path) -> str:
    """'measure.rows' for persistentkv/measure/rows.py; '' for persistentkv/__init__.py."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """A module's layer: its own row, else its package's (a package's modules share its layer)."""
    name = module or "persistentkv"
    if name in LAYERS:
        return LAYERS[name]
    return LAYERS[name.split(".")[0]]


def imports_of(module: str) -> set[str]:
    """Every module of ours that ``module`` imports anywhere in its file (top level, functions,
    TYPE_CHECKING blocks), as names under persistentkv ('' for the package itself)."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "persistentkv":
                base = node.module.split(".")[1:]
            else:
                continue
            target = ".".join(base)
            for alias in node.names:
                inner = f"{target}.{alias.name}" if target else alias.name
                found.add(inner if inner in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "persistentkv":
                    found.add(".".join(parts[1:]))
    found.discard(module)
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if (m or "persistentkv") not in LAYERS and m.split(".")[0] not in LAYERS)
    assert not unplaced, f"add these to the layers of persistentkv/__init__.py: {unplaced}"
    stale = sorted(n for n in LAYERS if n != "persistentkv" and n not in MODULES and n not in OWNED_ELSEWHERE)
    assert not stale, f"the layers name modules that do not exist: {stale}"


def test_the_table_parses():
    assert LAYERS["errors"] == 1 and LAYERS["commands"] > LAYERS["render"] > LAYERS["claims"] > LAYERS["results"]
    assert len(LAYERS) >= 20


@pytest.mark.parametrize("module", [m for m in MODULES if m.split(".")[0] not in OWNED_ELSEWHERE])
def test_imports_run_down_the_layers(module):
    """A module imports from lower layers only; modules of one package may import each other."""
    package = module.split(".")[0] if "." in module or (module and MODULES[module].name == "__init__.py") else None
    upward = []
    for target in sorted(imports_of(module)):
        same_package = package is not None and target.split(".")[0] == package
        if not same_package and layer_of(target) >= layer_of(module):
            upward.append(f"{target or 'persistentkv'} (layer {layer_of(target)})")
    assert not upward, f"{module or 'persistentkv'} (layer {layer_of(module)}) imports {', '.join(upward)}"


def test_no_circles():
    graph = {m: imports_of(m) & set(MODULES) for m in MODULES}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circle = path[path.index(n):] + [n]
                pytest.fail("circle: " + " -> ".join(x or "persistentkv" for x in circle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_a_function_local_import_that_climbs(tmp_path, monkeypatch):
    """The parser must see an import inside a function: a layer-1 module importing render."""
    fake = tmp_path / "io.py"
    fake.write_text("def f():\n    from .render import figures\n    from . import claims\n")
    monkeypatch.setitem(MODULES, "io", fake)
    assert imports_of("io") == {"render.figures", "claims"}
    with pytest.raises(AssertionError, match="imports claims"):
        test_imports_run_down_the_layers("io")
