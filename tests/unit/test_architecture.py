"""The floors of the package: each wing imports only from the wings below it.

Read from the source (no import runs), so a new arrow that breaks the design
fails here before anyone draws the tree: a lower floor reaching up, an import
circle, the geometry importing meshwise, checkpoints knowing a model. The
"Layout of the code" in docs/architecture.md lists the same wings in the same order,
and the README's "Dive into the code" walks them bottom to top.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshwise"

# Top to bottom: a wing may import only from the wings after it.
FLOORS = [
    "cli",
    "planner",
    "train",
    "serve",
    "apply",
    "hf",
    "sharding",
    "pipeline",
    "tensor_parallel",
    "context_parallel",
    "models",
    "checkpoint",
    "mesh",
    "comm",
    "device",
    "data",
    "geometry",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The meshwise modules ``path`` imports, wherever in the file (lazy imports too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return {m for m in found if m.startswith("meshwise.")}


def _wing(module: str) -> str:
    return module.split(".")[1]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _edges() -> dict[str, set[str]]:
    """module -> the package modules it imports (a ``from pkg import module`` counts
    as importing that module)."""
    modules = _modules()
    edges = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            while imported not in modules and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in modules and imported != name and imported != "meshwise":
                targets.add(imported)
        edges[name] = targets
    return edges


def test_every_wing_has_a_floor():
    wings = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        "mesh"
    }
    assert wings == set(FLOORS)
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "mesh.py"]


def test_each_wing_imports_only_from_lower_floors():
    upward = []
    for module, targets in _edges().items():
        if module in ("meshwise", "meshwise.__main__"):
            continue  # the public names and ``python -m meshwise`` stand above every floor
        floor = FLOORS.index(_wing(module))
        upward += [f"{module} -> {t}" for t in targets if FLOORS.index(_wing(t)) < floor]
    assert upward == []


def test_no_import_circles():
    edges, circles = _edges(), []

    def visit(module, path, done):
        for target in edges[module]:
            if target in path:
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in done:
                done.add(target)
                visit(target, path + [target], done)

    done: set[str] = set()
    for module in sorted(edges):
        if module not in done:
            done.add(module)
            visit(module, [module], done)
    assert circles == []


def test_the_geometry_imports_nothing_of_meshwise_and_checkpoints_no_model():
    edges = {m: ts for m, ts in _edges().items() if m not in ("meshwise", "meshwise.__main__")}
    outside = {
        m: sorted(t for t in ts if _wing(t) != "geometry")
        for m, ts in edges.items()
        if _wing(m) == "geometry"
    }
    assert all(not ts for ts in outside.values()), outside
    knowing = {
        m: sorted(
            t
            for t in ts
            if _wing(t) in ("models", "tensor_parallel", "apply") or t == "meshwise.geometry.plan"
        )
        for m, ts in edges.items()
        if _wing(m) == "checkpoint"
    }
    assert all(not ts for ts in knowing.values()), knowing


def test_the_docs_list_the_wings_in_their_floors_order():
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("## Layout of the code", 1)[1].split("```")[1]
    listed = [
        name.rstrip("/").removesuffix(".py")
        for name in re.findall(r"^  ([a-z_]+/|[a-z_]+\.py)", block, re.M)
    ]
    assert listed == FLOORS
    tour = (ROOT / "README.md").read_text().split("## Dive into the code", 1)[1]
    walked = [
        name.rstrip("/").removesuffix(".py")
        for name in re.findall(r"^- `([a-z_]+/|[a-z_]+\.py)`", tour, re.MULTILINE)
    ]
    assert walked == FLOORS[::-1]
