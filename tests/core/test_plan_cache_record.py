"""The plan key's code fingerprint of a package a wheel installed (plan_cache.installed_record): the RECORD of
its .dist-info, which holds every installed file's SHA-256 and which each install, upgrade or reinstall
rewrites, instead of a stat per module (~1.5 ms of every new process's creation). An editable install or a
source tree (no RECORD beside the package that lists its modules) is still keyed by every module's size and time.
"""

from __future__ import annotations

import os

import pytest
from onnx_runtime import plan_cache


@pytest.fixture
def site(tmp_path, on_disk_package):
    """A site-packages folder holding package ``wheeled`` (two folders deep), registered under its name, and a
    fingerprint reader that forgets what it computed (the real one is cached per process)."""
    _, fingerprint = on_disk_package("wheeled")
    return tmp_path, fingerprint


def _record(site, lines: list[str], name: str = "wheeled-1.0.dist-info"):
    info = site / name
    info.mkdir(exist_ok=True)
    (info / "RECORD").write_text("".join(f"{line}\n" for line in lines))
    return info / "RECORD"


WHEEL = ["wheeled/__init__.py,sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU,0",
         "wheeled/first.py,sha256=aaaa,6", "wheeled/inner/second.py,sha256=bbbb,6", "wheeled-1.0.dist-info/RECORD,,"]


def _touch(path, seconds: int = 1):
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 1_000_000_000))


def test_a_wheel_install_is_keyed_by_its_record(site):
    root, fingerprint = site
    _record(root, WHEEL)
    keyed = fingerprint()
    assert keyed == plan_cache.installed_record(str(root / "wheeled"))
    # no module is read: a module's time alone (outside any install) leaves the key (the walk would change it)
    _touch(root / "wheeled" / "inner" / "second.py")
    assert fingerprint() == keyed
    seen = {keyed}
    _record(root, [WHEEL[0], "wheeled/first.py,sha256=cccc,7", *WHEEL[2:]])  # an upgrade: another file hash
    seen.add(fingerprint())
    record = root / "wheeled-1.0.dist-info" / "RECORD"
    _touch(record)  # a reinstall of the same files rewrites the RECORD
    seen.add(fingerprint())
    assert len(seen) == 3


@pytest.mark.parametrize("layout", ["no dist-info", "editable", "another package", "unreadable"])
def test_anything_else_is_keyed_by_every_module(site, layout):
    root, fingerprint = site
    if layout == "editable":  # pip's editable RECORD lists its .pth and finder, no module of the package
        _record(root, ["__editable__.wheeled-1.0.pth,sha256=dddd,16", "wheeled-1.0.dist-info/RECORD,,"])
    elif layout == "another package":  # a dist-info of another name whose RECORD happens to list the package
        _record(root, WHEEL, name="wheeled_extras-1.0.dist-info")
    elif layout == "unreadable":
        (root / "wheeled-1.0.dist-info").mkdir()  # no RECORD
    assert plan_cache.installed_record(str(root / "wheeled")) is None
    before = fingerprint()
    _touch(root / "wheeled" / "inner" / "second.py")
    assert fingerprint() != before


def test_a_source_tree_beside_nothing_reads_no_record(tmp_path):
    assert plan_cache.installed_record(str(tmp_path / "missing" / "package")) is None
