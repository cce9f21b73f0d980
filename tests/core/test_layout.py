"""The codebase's layout holds: no import cycle between modules (function-level and type-checking imports
count too), no long module in core/ or an operator package, and no private name imported across modules.
Runs on the source tree, with or without providers installed."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"onnx_runtime": ROOT / "core" / "onnx_runtime"}
PACKAGES.update({path.name: path for path in sorted((ROOT / "providers").glob("*/onnx_runtime_ep_*")) if path.is_dir()})
LONGEST = 800
# Modules allowed past LONGEST lines, each with its reason. The goal is none.
LONG_EXCEPTIONS: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            modules[name] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the module, resolved to absolute names."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names in _imports(name, path):
            for target in [module] + [f"{module}.{n}" for n in names]:
                while target and target not in MODULES:
                    target = target.rpartition(".")[0]
                # A package's __init__ re-exports its modules: importing through it is not a knot.
                if target and target != name and not name.startswith(target + ".") \
                        and MODULES[target].name != "__init__.py":
                    edges[name].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """An import cycle (as the modules along it, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def test_no_import_cycles():
    assert _cycle(_edges()) is None


def test_the_cycle_check_finds_a_cycle():
    cycle = _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle is not None and set(cycle) == {"a", "b", "c"} and cycle[0] == cycle[-1]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_long_modules_in_core_or_operator_packages():
    long = {}
    for name, path in MODULES.items():
        if path.is_relative_to(ROOT / "core") or path.parent.name == "ops":
            lines = len(path.read_text().splitlines())
            if lines > LONGEST and name not in LONG_EXCEPTIONS:
                long[name] = lines
    assert long == {}, f"split these by concern (or list them in LONG_EXCEPTIONS with the reason): {long}"


# Packages that are one module split by concern: their parts share its internals, nothing outside may. The
# simulated CUDA driver keeps the driver's private state (handles, live-object ledgers) in sim/state.py and
# its API by concern in the other parts.
SPLIT_MODULES = ("onnx_runtime_ep_cuda.sim.",)


def _within_split_module(importer: str, module: str) -> bool:
    return any(importer.startswith(prefix) and module.startswith(prefix) for prefix in SPLIT_MODULES)


def test_no_private_name_imported_across_modules():
    private = [f"{name} imports {n} from {module}" for name, path in MODULES.items()
               for module, names in _imports(name, path) for n in names
               if n.startswith("_") and not n.startswith("__") and not _within_split_module(name, module)]
    assert private == []
