"""The finder of our packages' submodules (onnx_runtime/package_finder.py) answers exactly as importlib's path
finder would, or leaves the module to it."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import textwrap
from importlib.machinery import EXTENSION_SUFFIXES, PathFinder, SourceFileLoader

import pytest
from onnx_runtime import package_finder
from onnx_runtime.package_finder import PackageFinder


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A package ``served_pkg`` on sys.path with a module, a subpackage, a package folder beside a module of the
    same name, a namespace folder and an extension module's name beside a source; imported names cleaned up."""
    root = tmp_path / "served_pkg"
    (root / "sub").mkdir(parents=True)
    (root / "both").mkdir()
    (root / "spaced").mkdir()
    (root / "__init__.py").write_text("")
    (root / "plain.py").write_text("VALUE = 'plain'\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "leaf.py").write_text("VALUE = 'leaf'\n")
    (root / "both.py").write_text("VALUE = 'module'\n")
    (root / "both" / "__init__.py").write_text("VALUE = 'package'\n")
    (root / "spaced" / "part.py").write_text("VALUE = 'part'\n")
    (root / "native.py").write_text("VALUE = 'source'\n")
    (root / f"native{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "served_pkg" or m.startswith("served_pkg.")]:
        del sys.modules[name]


def test_it_finds_what_the_path_finder_finds_and_leaves_the_rest(tree):
    finder = PackageFinder()
    finder.prefixes = ("served_pkg.",)
    top = [str(tree)]
    for name, path in (("served_pkg.plain", top), ("served_pkg.sub", top), ("served_pkg.both", top),
                       ("served_pkg.sub.leaf", [str(tree / "sub")])):
        ours, theirs = finder.find_spec(name, path), PathFinder.find_spec(name, path)
        assert ours is not None, name
        assert (ours.name, ours.origin, ours.cached, ours.parent, ours.has_location) == \
            (theirs.name, theirs.origin, theirs.cached, theirs.parent, theirs.has_location)
        assert ours.submodule_search_locations == theirs.submodule_search_locations
    # left to importlib: an extension module's name, a namespace folder, a missing name, other packages, a
    # namespace __path__ (not a plain list), more than one folder
    assert finder.find_spec("served_pkg.native", top) is None
    assert finder.find_spec("served_pkg.spaced", top) is None
    assert finder.find_spec("served_pkg.absent", top) is None
    assert finder.find_spec("other_pkg.plain", top) is None
    assert finder.find_spec("served_pkg.plain", tuple(top)) is None
    assert finder.find_spec("served_pkg.plain", [*top, str(tree / "sub")]) is None


def test_a_served_package_imports_through_it_and_sees_changes_as_importlib_does(tree, monkeypatch):
    finder = PackageFinder()
    monkeypatch.setattr(package_finder, "FINDER", finder)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    package_finder.serve("served_pkg")
    assert sys.meta_path[0] is finder and finder.prefixes == ("served_pkg.",)
    package_finder.serve("served_pkg")
    assert sys.meta_path.count(finder) == 1 and finder.prefixes == ("served_pkg.",)

    import served_pkg.both
    import served_pkg.plain
    import served_pkg.spaced.part
    import served_pkg.sub.leaf

    assert (served_pkg.plain.VALUE, served_pkg.sub.leaf.VALUE, served_pkg.both.VALUE) == ("plain", "leaf", "package")
    assert type(served_pkg.spaced.part.__spec__.loader) is SourceFileLoader  # (a namespace's part: importlib's)
    assert isinstance(served_pkg.plain.__spec__.loader, package_finder._Loader)  # noqa: SLF001
    assert served_pkg.plain.__cached__ == importlib.util.cache_from_source(served_pkg.plain.__file__)

    # a module added after the folder was listed: importlib's finder finds it
    (tree / "added.py").write_text("VALUE = 'added'\n")
    assert importlib.import_module("served_pkg.added").VALUE == "added"
    # a listed module removed since: the missing module, as importlib reports it
    (tree / "sub" / "gone.py").write_text("VALUE = 'gone'\n")
    finder.invalidate_caches()
    assert finder.find_spec("served_pkg.sub.gone", [str(tree / "sub")]) is not None
    (tree / "sub" / "gone.py").unlink()
    with pytest.raises(ModuleNotFoundError, match="served_pkg.sub.gone"):
        importlib.import_module("served_pkg.sub.gone")
    finder.invalidate_caches()
    assert finder.listings == {}


def test_a_new_process_finds_our_submodules_through_it():
    """The runtime's and the CPU provider's submodules come through the finder from their first import on, and
    each is the module importlib's path finder would have found."""
    script = textwrap.dedent("""
        import json, sys
        from importlib.machinery import PathFinder
        import onnx_runtime, onnx_runtime_ep_cpu.ops.conv
        rows = []
        for name, module in list(sys.modules.items()):
            if name.startswith(("onnx_runtime.", "onnx_runtime_ep_cpu.")) and getattr(module, "__spec__", None):
                parent = sys.modules[name.rpartition(".")[0]]
                theirs = PathFinder.find_spec(name, parent.__path__)
                rows.append([name, type(module.__spec__.loader).__name__, module.__file__,
                             theirs.origin if theirs else None])
        print(json.dumps(rows))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name for name, *_ in rows}
    assert {"onnx_runtime.session", "onnx_runtime_ep_cpu.provider", "onnx_runtime_ep_cpu.ops.conv"} <= names
    served = [row for row in rows if row[1] == "_Loader"]
    assert len(served) >= 0.9 * len(rows), [row for row in rows if row[1] != "_Loader"]
    assert all(file == origin for _, _, file, origin in served)
