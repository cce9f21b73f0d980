"""Finding providers: entry points of the ``onnx_runtime.providers`` group, plus in-process
registrations. A plugin that fails to import or has invalid hooks produces a warning naming it and
the reason; the others still load. Nothing here imports a provider package by name.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import tempfile
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

from .contract.deferred import DeferredProvider
from .contract.hookspecs import DiscoverySpec
from .contract.kernels import Availability
from .contract.markers import PROJECT
from .contract.version import incompatibility
from .errors import InvalidArgumentError, PluginError, ProviderNotAvailableError
from .provider_handle import ProviderHandle
from .records import FrozenRecord, Record

ENTRY_POINT_GROUP = "onnx_runtime.providers"
KEPT_LISTINGS = 8  # listings kept per folder: one per import-path state (scripts run from several folders)


def entry_points(**selection) -> list:
    """importlib.metadata's listing, imported here: that module (and the email parser it pulls in) is a
    noticeable part of a fresh process's import, and a process whose listing is kept never needs it."""
    from importlib.metadata import entry_points as listing  # entry_points(group=...): Python >= 3.10

    return list(listing(**selection))

# How to install the providers that ship with the project, keyed by short name.
EXTRAS = {"cpu": "pip install 'onnx-runtime[cpu]'", "cuda": "pip install 'onnx-runtime[cuda]'"}


class ProviderEntry(Record):
    """A discovered provider class and what is known of it without initializing a device.

    Its availability is probed at the first question, not at discovery: a probe may load a device library
    (cuda-python and the driver), which a session that asks only for other providers should not pay for.
    """

    # (compared and shown: the description; the probe, its answer and the spare handles are not)
    __match_args__ = ("cls", "name", "short_name", "source", "distribution", "version", "device", "contract_version",
                      "selected_by_default", "hooks")
    cls: Callable[[], object]  # a provider class, or a factory returning an instance registered in-process
    name: str
    short_name: str
    source: str
    distribution: str
    version: str
    device: str
    contract_version: str
    selected_by_default: bool  # used by sessions that name no providers
    hooks: list[str] | None  # None for a deferred provider until its class is imported
    probe: Callable[[], Availability] | None
    _availability: Availability | None
    # the handle discovery built to read the provider's name and hooks, uninitialized: the first create() takes it
    # (building a handle's plugin managers is a noticeable part of a fresh process's first session)
    spares: list[ProviderHandle]

    def __init__(self, cls: Callable[[], object], name: str, short_name: str, source: str, distribution: str = "",
                 version: str = "", device: str = "cpu:0", contract_version: str = "", selected_by_default: bool = True,
                 hooks: list[str] | None = None, probe: Callable[[], Availability] | None = None,
                 _availability: Availability | None = None, spares: list[ProviderHandle] | None = None) -> None:
        self.cls = cls
        self.name = name
        self.short_name = short_name
        self.source = source
        self.distribution = distribution
        self.version = version
        self.device = device
        self.contract_version = contract_version
        self.selected_by_default = selected_by_default
        self.hooks = hooks
        self.probe = probe
        self._availability = _availability
        self.spares = [] if spares is None else spares

    @property
    def availability(self) -> Availability:
        """Whether the provider can run here (its ``availability`` hook, asked once)."""
        if self._availability is None:
            self._availability = self.probe() if self.probe is not None else Availability.yes()
        return self._availability

    @property
    def implemented_hooks(self) -> list[str]:
        """The hooks the provider implements itself (a deferred provider's class is imported to answer)."""
        if self.hooks is None:
            handle = self.create()
            self.hooks = handle.implemented_hooks
            self.spares.append(handle)
        return list(self.hooks)

    def create(self) -> ProviderHandle:
        """A fresh, uninitialized instance behind its own handle."""
        try:
            return self.spares.pop()  # (atomic: two sessions created at once never share it)
        except IndexError:
            pass
        try:
            provider = self.cls()
        except Exception as exc:
            if not isinstance(self.cls, DeferredProvider):
                raise
            raise PluginError(f"{self.source}: importing provider {self.name!r} failed: {type(exc).__name__}: {exc}; "
                              f"reinstall the distribution that provides it") from exc
        handle = ProviderHandle(provider, source=self.source)
        if handle.name != self.name:  # a deferred provider's description disagrees with its class
            raise PluginError(f"{self.source}: the provider class is named {handle.name!r} but was described as "
                              f"{self.name!r}; make the plugin's DeferredProvider name match its class")
        return handle


class BrokenPlugin(Record):
    __match_args__ = ("source", "reason", "entry_point")
    source: str
    reason: str
    entry_point: str  # the entry point's name ("cpu"), when the plugin came from one

    def __init__(self, source: str, reason: str, entry_point: str = "") -> None:
        self.source = source
        self.reason = reason
        self.entry_point = entry_point


class ProviderRegistry:
    """The process-wide set of providers. ``registry()`` returns the shared instance."""

    def __init__(self):
        self._lock = threading.RLock()
        self._entries: list[ProviderEntry] = []
        self._discovered = False  # the entry points are loaded at the first query, and again after refresh()
        self._quick: dict[str, ProviderEntry] = {}  # find()'s answers from one entry point, before discovery
        self._in_process: list[tuple[object, str]] = []
        self.broken: list[BrokenPlugin] = []

    # -- registration -----------------------------------------------------------------------------
    def register(self, plugin, source: str = "in-process") -> list[ProviderEntry]:
        """Register a provider class, or a plugin object/module implementing ``onnx_runtime_providers``."""
        with self._lock:
            self.entries()
            added = self._add(plugin, source, dist="", version="", strict=True)
            self._in_process.append((plugin, source))  # re-added when the entry points are reloaded
            return added

    def unregister(self, name: str) -> None:
        with self._lock:
            entries = self.entries()
            gone = {e.source for e in entries if _matches(e, name)}
            if not gone:
                registered = [e.name for e in entries]
                raise InvalidArgumentError(f"no provider named {name!r} is registered; registered: {registered}")
            self._entries = [e for e in entries if not _matches(e, name)]
            self._in_process = [(p, s) for p, s in self._in_process if s not in gone]

    def refresh(self) -> None:
        """Forget what was discovered; the next query loads the entry points again."""
        with self._lock:
            self._entries = []
            self._discovered = False
            self._quick = {}
            self.broken = []

    # -- queries --------------------------------------------------------------------------------
    def entries(self) -> list[ProviderEntry]:
        with self._lock:
            if not self._discovered:
                self._discover()
            return list(self._entries)

    def find(self, name: str) -> ProviderEntry | None:
        quick = self._quick_find(name)
        if quick is not None:
            return quick
        for entry in self.entries():
            if _matches(entry, name):
                return entry
        return None

    def require(self, name: str) -> ProviderEntry:
        entry = self.find(name)
        if entry is None:
            known = [e.name for e in self.entries()]
            key = name.lower().removesuffix("executionprovider")
            broken = [b for b in self.broken if b.entry_point and b.entry_point.lower() == key]
            if broken:
                raise ProviderNotAvailableError(
                    f"execution provider {name!r} is installed but its plugin is broken: {broken[0].source}: "
                    f"{broken[0].reason}; fix or reinstall that distribution"
                )
            extra = EXTRAS.get(name.lower().replace("executionprovider", ""))
            hint = f"install it with `{extra}`" if extra else "install the distribution that provides it"
            raise ProviderNotAvailableError(
                f"execution provider {name!r} is not installed (installed: {known or 'none'}); {hint}"
            )
        return entry

    # -- discovery ------------------------------------------------------------------------------
    def _quick_find(self, name: str) -> ProviderEntry | None:
        """Before the first full discovery: the provider of the one entry point named after ``name`` ("cpu"
        for CPUExecutionProvider), loaded alone, so that a session naming its providers imports no other
        provider package. Anything else (no such entry point, several, a failure, a provider of another name)
        is left to full discovery, which reports broken plugins."""
        key = name.lower().removesuffix("executionprovider")
        with self._lock:
            if self._discovered:
                return None
            if key not in self._quick:
                named = [ep for ep in listed_entry_points() if ep.name.lower() == key]
                if len(named) != 1:
                    return None
                source, dist_name, version = _describe(named[0])
                try:
                    classes = _provider_classes(named[0].load())
                    found = [_entry(cls, source, dist_name, version) for cls in classes]
                except Exception:
                    return None
                found = [entry for entry in found if _matches(entry, name)]
                if len(found) != 1:
                    return None
                self._quick[key] = found[0]
            entry = self._quick[key]
            return entry if _matches(entry, name) else None

    def _discover(self) -> None:
        self._entries = []
        self._discovered = True
        self.broken = []
        for ep, plugin, exc in _loaded_entry_points():
            source, dist_name, version = _describe(ep)
            if exc is not None:
                self._broken(source, f"import failed: {type(exc).__name__}: {exc}", ep.name)
                continue
            if not self._add(plugin, source, dist_name, version, strict=False) and self.broken \
                    and self.broken[-1].source == source:
                self.broken[-1].entry_point = ep.name
        for plugin, source in self._in_process:
            self._add(plugin, source, dist="", version="", strict=False)

    def _add(self, plugin, source: str, dist: str, version: str, strict: bool) -> list[ProviderEntry]:
        added = []
        try:
            classes = _provider_classes(plugin)
        except Exception as exc:
            return self._fail(source, f"its onnx_runtime_providers hook failed: {exc}", strict)
        for cls in classes:
            try:
                entry = _entry(cls, source, dist, version)
            except Exception as exc:
                self._fail(source, f"provider {getattr(cls, '__name__', cls)!r} is invalid: {exc}", strict)
                continue
            if any(_matches(e, entry.name) for e in self._entries):
                self._fail(source, f"provider name {entry.name!r} is already registered", strict)
                continue
            self._entries.append(entry)
            added.append(entry)
        return added

    def _fail(self, source: str, reason: str, strict: bool) -> list:
        if strict:
            raise PluginError(f"{source}: {reason}")
        self._broken(source, reason)
        return []

    def _broken(self, source: str, reason: str, entry_point: str = "") -> None:
        self.broken.append(BrokenPlugin(source, reason, entry_point))
        warnings.warn(f"onnx-runtime: skipping {source}: {reason}", RuntimeWarning, stacklevel=3)


class ListedEntryPoint(FrozenRecord):
    """An entry point of the group as an earlier process listed it (``listed_entry_points``)."""

    __slots__ = __match_args__ = ("name", "value", "dist_name", "version")
    name: str
    value: str
    dist_name: str
    version: str

    def __init__(self, name: str, value: str, dist_name: str, version: str) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "dist_name", dist_name)
        object.__setattr__(self, "version", version)

    def load(self):
        """The object ``module:attr.attr [extras]`` names, as importlib.metadata's EntryPoint.load finds it."""
        module, _, attrs = self.value.partition("[")[0].strip().partition(":")
        found = importlib.import_module(module.strip())
        for attr in filter(None, attrs.strip().split(".")):
            found = getattr(found, attr)
        return found


def listed_entry_points() -> list:
    """The group's entry points. Listing them reads every installed distribution's metadata (milliseconds per
    fresh process), so the list is kept beside the plan cache (plan_cache.py; off with it), keyed by the import
    path and each of its folders' modification times, which an install, upgrade or removal changes. A stale or
    unreadable list only costs the listing: a provider that fails to load from it is left to full discovery."""
    if os.environ.get("ONNX_RUNTIME_PLAN_CACHE", "1") == "0":
        return entry_points(group=ENTRY_POINT_GROUP)
    state = []
    for index, folder in enumerate(sys.path):
        try:  # (the script's folder or the working directory, sys.path[0], by name: its files change all the time)
            state.append([folder, os.stat(folder or ".").st_mtime_ns if index else None])
        except OSError:
            state.append([folder, None])
    key = hashlib.sha256(json.dumps([sys.version, ENTRY_POINT_GROUP, state]).encode()).hexdigest()[:32]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(os.environ.get("ONNX_RUNTIME_PLAN_CACHE_DIR") or os.path.join(base, "onnx_runtime", "plans"),
                        "entry-points.json")  # one file: the latest listings, whatever their keys
    kept: list = []
    try:
        with open(path) as handle:
            kept = [listing for listing in json.load(handle)["listings"]
                    if isinstance(listing, dict) and isinstance(listing.get("rows"), list)]
        for listing in kept:
            if listing.get("key") == key:
                return [ListedEntryPoint(*row) for row in listing["rows"]]
    except (OSError, ValueError, TypeError, KeyError):
        kept = []
    found = entry_points(group=ENTRY_POINT_GROUP)
    rows = [[ep.name, ep.value, *_describe(ep)[1:]] for ep in found]
    kept = [{"key": key, "rows": rows}, *kept][:KEPT_LISTINGS]
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".writing-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump({"listings": kept}, handle)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError:
        pass  # an unwritable folder: list again next time (the plan cache warns about it)
    return found


def _loaded_entry_points() -> list[tuple]:
    """``(entry point, what it loads or None, the error or None)`` for every entry point of the group, sorted by
    name: from the kept listing (listed_entry_points: a new listing reads every installed distribution's
    metadata), or from a new listing where a kept entry point does not load, so a stale listing costs no provider
    and reports nothing that is not installed."""
    loaded = _load_each(listed_entry_points())
    if any(isinstance(ep, ListedEntryPoint) and exc is not None for ep, _, exc in loaded):
        loaded = _load_each(entry_points(group=ENTRY_POINT_GROUP))
    return loaded


def _load_each(found) -> list[tuple]:
    loaded: list[tuple] = []
    for ep in sorted(found, key=lambda e: e.name):
        try:
            loaded.append((ep, ep.load(), None))
        except Exception as exc:  # (reported by the discovery as a broken plugin)
            loaded.append((ep, None, exc))
    return loaded


def _describe(ep) -> tuple[str, str, str]:
    """An entry point's description for messages, its distribution's name and version."""
    if isinstance(ep, ListedEntryPoint):
        return (f"entry point {ep.name!r} ({ep.value}) of {ep.dist_name or 'an unknown distribution'}", ep.dist_name,
                ep.version)
    dist = getattr(ep, "dist", None)
    dist_name = dist.metadata["Name"] if dist is not None else ""
    version = dist.version if dist is not None else ""
    return f"entry point {ep.name!r} ({ep.value}) of {dist_name or 'an unknown distribution'}", dist_name, version


def _entry(cls, source: str, dist: str, version: str) -> ProviderEntry:
    """What is known of a provider: read from an instance's hooks, or from a deferred provider's description
    (its class is not imported until a session creates it)."""
    if isinstance(cls, DeferredProvider):
        incompatible = incompatibility(cls.contract_version)  # (an invalid version: ValueError, a broken plugin)
        probe = (lambda: Availability.no(incompatible)) if incompatible is not None else cls.availability
        return ProviderEntry(cls=cls, name=cls.name, short_name=cls.short_name, source=source, distribution=dist,
                             version=version, device=cls.device, contract_version=cls.contract_version,
                             selected_by_default=cls.selected_by_default, probe=probe)
    handle = ProviderHandle(cls(), source=source)
    return ProviderEntry(cls=cls, name=handle.name, short_name=handle.short_name, source=source, distribution=dist,
                         version=version, device=str(handle.device_id), contract_version=handle.contract_version,
                         selected_by_default=bool(handle.hook.selected_by_default()),
                         hooks=handle.implemented_hooks, probe=handle.availability, spares=[handle])


def _provider_classes(plugin) -> list[Callable[[], object]]:
    """The provider factories a plugin contributes: a class is its own contribution, and a provider
    instance registered in-process is shared by every session that uses it."""
    if isinstance(plugin, DeferredProvider) or isinstance(plugin, type) and not hasattr(
            plugin, "onnx_runtime_providers"):
        return [plugin]
    if not isinstance(plugin, type) and callable(getattr(plugin, "name", None)) and hasattr(
        plugin.name, f"{PROJECT}_impl"
    ):
        return [lambda: plugin]
    hook = _plain_discovery_hook(plugin)
    if hook is not None:  # what pluggy's call of the one implementation returns, without building its manager
        classes: list[Callable[[], object]] = list(hook() or [])
        if not classes:
            raise PluginError("it contributes no provider classes (implement `onnx_runtime_providers`)")
        return classes
    import pluggy  # (loaded only for a plugin whose hooks pluggy must read)

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(DiscoverySpec)
    try:
        pm.register(plugin)
    except pluggy.PluginValidationError as exc:
        raise PluginError(str(exc)) from None
    classes = [cls for group in pm.hook.onnx_runtime_providers() for cls in (group or [])]
    if not classes:
        raise PluginError("it contributes no provider classes (implement `onnx_runtime_providers`)")
    return classes


def _plain_discovery_hook(plugin) -> Callable[[], Any] | None:
    """A module's ``onnx_runtime_providers``: a plain function of no arguments, marked without options that
    change its call (entry points name such modules); None where pluggy must register the plugin."""
    if not isinstance(plugin, types.ModuleType):
        return None
    hook = vars(plugin).get("onnx_runtime_providers")
    if not isinstance(hook, types.FunctionType):
        return None
    opts = getattr(hook, f"{PROJECT}_impl", None)
    if not isinstance(opts, dict) or any(opts.get(key) for key in opts if key not in ("tryfirst", "trylast")) \
            or hook.__code__.co_argcount or hasattr(hook, "__wrapped__"):
        return None
    return hook


def _matches(entry: ProviderEntry, name: str) -> bool:
    return name.lower() in (entry.name.lower(), entry.short_name.lower())


_REGISTRY = ProviderRegistry()


def registry() -> ProviderRegistry:
    return _REGISTRY


def get_all_providers() -> list[str]:
    """Names of every installed provider, available or not."""
    return [e.name for e in _REGISTRY.entries()]


def get_available_providers() -> list[str]:
    """Names of installed providers that can run on this machine, device providers first."""
    entries = [e for e in _REGISTRY.entries() if e.availability.available]
    entries.sort(key=lambda e: e.device.startswith("cpu"))
    return [e.name for e in entries]


def default_providers() -> list[str]:
    """The providers a session that names none uses: the available ones whose ``selected_by_default`` hook says
    so, device providers first."""
    chosen = {e.name for e in _REGISTRY.entries() if e.selected_by_default}
    return [name for name in get_available_providers() if name in chosen]


def register_provider(plugin) -> list[str]:
    """Register a provider class (or a plugin with ``onnx_runtime_providers``) in this process."""
    return [e.name for e in _REGISTRY.register(plugin, source=f"in-process {getattr(plugin, '__name__', plugin)!r}")]


def unregister_provider(name: str) -> None:
    _REGISTRY.unregister(name)
