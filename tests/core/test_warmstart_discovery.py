"""Provider discovery on a warm start (discovery.listed_entry_points): a distribution installed on, then removed
from, a folder of the import path is seen at the next listing; several import-path states (scripts run from
different folders) each keep their listing rather than replacing one another; a kept entry point loads as
importlib.metadata's would."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
from onnx_runtime import discovery


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "1")
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE_DIR", str(tmp_path / "plans"))
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])  # (sys.path[0] is keyed by its name only)
    return folder


def _changed(folder, before: int) -> None:
    """An install or removal changes the folder's time; within one clock tick it may read the same."""
    if os.stat(folder).st_mtime_ns == before:
        os.utime(folder, ns=(before + 1000, before + 1000))


def _install(folder, name: str, entry: str) -> None:
    before = os.stat(folder).st_mtime_ns
    info = folder / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{discovery.ENTRY_POINT_GROUP}]\n{entry}\n")
    _changed(folder, before)


def _names(listed) -> dict[str, tuple[str, str]]:
    """name -> (value, distribution), for a kept entry point and for importlib.metadata's alike."""
    return {ep.name: (ep.value, ep.dist_name if isinstance(ep, discovery.ListedEntryPoint)
                      else ep.dist.metadata["Name"]) for ep in listed}


def test_an_installed_then_removed_distribution_is_seen(site, monkeypatch):
    assert "warmprobe" not in _names(discovery.listed_entry_points())
    _install(site, "warmstart-probe", "warmprobe = warmstart_probe_plugin:Provider")
    found = _names(discovery.listed_entry_points())
    assert found["warmprobe"] == ("warmstart_probe_plugin:Provider", "warmstart-probe")
    listings = []
    original = discovery.entry_points
    monkeypatch.setattr(discovery, "entry_points", lambda **kw: listings.append(kw) or original(**kw))
    assert _names(discovery.listed_entry_points()) == found  # read back, not listed again
    assert listings == []
    before = os.stat(site).st_mtime_ns
    shutil.rmtree(site / "warmstart_probe-1.0.dist-info")
    _changed(site, before)
    assert "warmprobe" not in _names(discovery.listed_entry_points())
    assert listings == [{"group": discovery.ENTRY_POINT_GROUP}]


def test_each_import_path_state_keeps_its_listing(site, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    other.mkdir()
    discovery.listed_entry_points()
    with_other = [*sys.path, str(other)]
    monkeypatch.setattr(sys, "path", with_other)
    discovery.listed_entry_points()
    kept = json.loads((tmp_path / "plans" / "entry-points.json").read_text())["listings"]
    assert len(kept) == 2
    listings = []
    monkeypatch.setattr(discovery, "entry_points", lambda **kw: listings.append(kw) or [])
    for path in (with_other[:-1], with_other, with_other[:-1]):  # alternating states: each read back
        monkeypatch.setattr(sys, "path", path)
        assert any(ep.name == "cpu" for ep in discovery.listed_entry_points())
    assert listings == []


def test_a_damaged_listing_is_listed_again(site, tmp_path):
    path = tmp_path / "plans" / "entry-points.json"
    discovery.listed_entry_points()
    for damage in ('{"listings": [{"key": 1, "rows": "x"}]}', '{"key": "old format", "rows": []}', "not json"):
        path.write_text(damage)
        assert any(ep.name == "cpu" for ep in discovery.listed_entry_points())
        assert json.loads(path.read_text())["listings"][0]["rows"]


def test_a_kept_entry_point_loads_what_it_names():
    import os.path as posixpath

    def kept(value: str):
        return discovery.ListedEntryPoint("probe", value, "", "")

    assert kept("os.path:join").load() is posixpath.join
    assert kept("json").load() is json
    assert kept("json : decoder.JSONDecoder [extra]").load() is json.decoder.JSONDecoder
    with pytest.raises(ImportError):
        kept("no_such_module_for_warmstart:thing").load()
