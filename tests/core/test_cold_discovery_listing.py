"""Provider entry points listed once and kept beside the plan cache (discovery.listed_entry_points): a later
process reads the list instead of every distribution's metadata; an install (a changed import-path folder) lists
again; a stale list never costs a provider; with the plan cache off nothing is kept."""

from __future__ import annotations

import json
import os
import sys

import pytest
from onnx_runtime import discovery


@pytest.fixture
def listing(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "1")
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE_DIR", str(tmp_path))
    return tmp_path / "entry-points.json"


def _refuse_listing(monkeypatch):
    def refuse(**kwargs):
        raise AssertionError("the installed distributions were listed again")

    monkeypatch.setattr(discovery, "entry_points", refuse)


def test_the_list_is_kept_and_read_back(listing, monkeypatch):
    first = {(ep.name, ep.value) for ep in discovery.listed_entry_points()}
    assert ("cpu", "onnx_runtime_ep_cpu.plugin") in first and listing.is_file()
    _refuse_listing(monkeypatch)
    again = discovery.listed_entry_points()
    assert {(ep.name, ep.value) for ep in again} == first
    entry = discovery.ProviderRegistry().require("CPUExecutionProvider")  # loaded from the kept list
    assert (entry.name, entry.distribution) == ("CPUExecutionProvider", "onnx-runtime-ep-cpu")
    assert "onnx-runtime-ep-cpu" in entry.source and entry.version


def test_an_install_lists_again(listing, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])  # (sys.path[0] is keyed by its name only)
    discovery.listed_entry_points()
    os.utime(site, ns=(1, 1))  # a distribution added or removed there
    calls = []
    original = discovery.entry_points
    monkeypatch.setattr(discovery, "entry_points", lambda **kw: calls.append(kw) or original(**kw))
    discovery.listed_entry_points()
    assert calls == [{"group": discovery.ENTRY_POINT_GROUP}]


def test_a_stale_list_costs_no_provider(listing, monkeypatch):
    discovery.listed_entry_points()
    kept = json.loads(listing.read_text())
    kept["listings"][0]["rows"] = [["cpu", "no_such_module_here.plugin", "gone", "0"]]
    listing.write_text(json.dumps(kept))
    entry = discovery.ProviderRegistry().require("CPUExecutionProvider")  # full discovery finds the real one
    assert entry.name == "CPUExecutionProvider"


def test_nothing_is_kept_with_the_plan_cache_off(listing, monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "0")
    assert any(ep.name == "cpu" for ep in discovery.listed_entry_points())
    assert not listing.exists()


def test_full_discovery_reads_the_kept_list(listing, monkeypatch):
    discovery.listed_entry_points()
    _refuse_listing(monkeypatch)
    registry = discovery.ProviderRegistry()
    names = [entry.name for entry in registry.entries()]  # every provider, as a session naming none asks
    assert "CPUExecutionProvider" in names and not registry.broken


def test_full_discovery_lists_again_where_a_kept_entry_point_does_not_load(listing, monkeypatch, recwarn):
    discovery.listed_entry_points()
    kept = json.loads(listing.read_text())
    kept["listings"][0]["rows"].append(["gone", "no_such_module_here.plugin", "gone-dist", "0"])
    listing.write_text(json.dumps(kept))
    calls = []
    original = discovery.entry_points
    monkeypatch.setattr(discovery, "entry_points", lambda **kw: calls.append(kw) or original(**kw))
    registry = discovery.ProviderRegistry()
    assert "CPUExecutionProvider" in [entry.name for entry in registry.entries()]
    assert calls == [{"group": discovery.ENTRY_POINT_GROUP}]  # the stale list was replaced by a new listing
    assert not any("no_such_module_here" in str(b) for b in registry.broken)  # nothing reported that is not there
    assert not any("no_such_module_here" in str(w.message) for w in recwarn)
