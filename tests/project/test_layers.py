"""The layer rules of docs/design.md ("Layers"), read from its table: every module of src/gpupool has one
layer, and imports (any import, inside functions too) only modules of its own layer or of layers below
it; the kernels hold no Python state; the device modules choose the kernels' backend before they
import a kernel (gpupool/_backend.py)."""
from harness.paths import ROOT
import ast
import re
from pathlib import Path

import pytest

SRC = ROOT / "src"
PKG = SRC / "gpupool"
KERNELS = PKG / "kernels"
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "discard",
            "remove", "__setitem__"}


def layer_table() -> list[tuple[str, list[Path]]]:
    """The table's rows, top (highest layer) first: (layer, paths of its "where" cell). A bare name in
    a cell (``keys.py``) is in the folder of the path before it."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        paths, folder = [], None
        for token in re.findall(r"`([^`]+)`", cells[1]):
            if token.startswith("src/"):
                path = ROOT / token
            else:
                assert folder is not None, f"{cells[0]}: {token!r} comes before any full path"
                path = folder / token
            folder = path if token.endswith("/") else path.parent
            paths.append(path)
        rows.append((cells[0], paths))
    return rows


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def gpupool_imports(path: Path, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(module imported, line) for each gpupool module ``path`` imports (``from pkg import mod`` names
    the module ``pkg.mod`` where that is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if module_level_only else ast.walk(tree)
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "gpupool"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "gpupool":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if module_path(sub) else target, node.lineno))
    return out


def layer_of() -> dict[Path, tuple[int, str]]:
    """Each module of src/gpupool and (its layer's height: 0 the bottom, the layer): the row whose path
    names it most closely (a file, else the deepest folder holding it)."""
    rows = layer_table()
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        best = None
        for height, (layer, paths) in enumerate(reversed(rows)):
            for p in paths:
                if p == path or (p.is_dir() and path.is_relative_to(p)):
                    depth = len(p.parts) + (p == path)
                    if best is None or depth > best[0]:
                        best = (depth, height, layer)
        if best:
            out[path] = best[1:]
    return out


def test_the_table_names_real_paths_and_every_module_has_a_layer():
    rows = layer_table()
    assert len(rows) >= 8, rows
    missing = [f"{layer}: {p.relative_to(ROOT)}" for layer, paths in rows for p in paths if not p.exists()]
    assert not missing, f"docs/design.md's layer table names paths that do not exist: {missing}"
    layers = layer_of()
    unplaced = [str(p.relative_to(ROOT)) for p in sorted(PKG.rglob("*.py")) if p not in layers]
    assert not unplaced, f"modules in no layer of docs/design.md's table: {unplaced}"


def test_each_module_imports_only_its_layer_and_layers_below():
    layers = layer_of()
    wrong = []
    for path, (height, layer) in layers.items():
        for target, line in gpupool_imports(path):
            target_path = module_path(target)
            assert target_path is not None, f"{path.relative_to(ROOT)}:{line} imports {target}, not a module"
            t_height, t_layer = layers[target_path]
            if t_height > height:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({layer}) imports {target} ({t_layer})")
    assert not wrong, "imports of a higher layer:\n" + "\n".join(wrong)


def _kernel_modules():
    return sorted(KERNELS.rglob("*.py"))


@pytest.mark.parametrize("path", _kernel_modules(), ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernels_hold_no_python_state(path):
    """A kernel module imports from gpupool only kernel modules and the error types (no module with
    state), declares no ``global``, and no function in it writes a module-level name (item assignment,
    augmented assignment, a mutating method)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for target, line in gpupool_imports(path):
        if not (target.startswith("gpupool.kernels") or target == "gpupool.errors"):
            found.append(f"line {line}: imports {target}")
    module_names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            module_names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module_names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                found.append(f"line {node.lineno}: {type(node).__name__.lower()} {', '.join(node.names)}")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    base = t.value if isinstance(t, (ast.Subscript, ast.Attribute)) else None
                    if isinstance(base, ast.Name) and base.id in module_names:
                        found.append(f"line {node.lineno}: writes into {base.id}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id in module_names
                  and node.func.value.id not in ("tl", "triton")  # Triton's ops (tl.add) change no module
                  and node.func.attr in MUTATORS):
                found.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}(...)")
    assert not found, f"{path.relative_to(ROOT)} holds Python state: {found}"


def test_device_modules_choose_the_backend_before_their_kernels():
    """A module outside kernels/ that imports a kernel module (``kernels.layout``, plain constants,
    aside) calls ``_backend.select()`` at module level before that import: importing the kernels
    chooses nothing itself (docs/design.md, "Without a GPU")."""
    late = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(KERNELS):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = [(t, line) for t, line in gpupool_imports(path, module_level_only=True)
                   if t.startswith("gpupool.kernels") and t != "gpupool.kernels.layout"]
        if not imports:
            continue
        selects = [n.lineno for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                   and ast.unparse(n.value.func) == "_backend.select"]
        first = min(line for _, line in imports)
        if not selects or min(selects) > first:
            late.append(f"{path.relative_to(ROOT)}:{first} imports {imports[0][0]}")
    assert not late, f"kernel imports with no _backend.select() before them: {late}"
