"""The fixtures, backend parametrization and summary of ``onnx_runtime.testing`` (registered only in runs that
enable the plugin; see onnx_runtime_pytest.py)."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from . import cases
from . import contract as contract_checks

NODE, MODEL, CONTRACT = "onnx_backend_node", "onnx_backend_model", "provider_contract_hook"
LABELS = {NODE: "backend node cases", MODEL: "backend model sets", CONTRACT: "contract checks"}


class Target:
    """The provider under test, as this run names it."""

    def __init__(self, config):
        name = config.getoption("onnx_runtime_provider") or config.getini("onnx_runtime_provider")
        if not name:
            raise pytest.UsageError("onnx_runtime.testing: name the provider under test with --provider NAME "
                                    "(or onnx_runtime_provider = NAME in the ini file)")
        from ..discovery import registry

        entry = registry().find(name)
        if entry is None:
            known = [e.name for e in registry().entries()]
            raise pytest.UsageError(f"onnx_runtime.testing: --provider {name!r} is not installed (installed: "
                                    f"{known or 'none'}); install its distribution or register it in a conftest")
        self.entry = entry
        self.name = self.entry.name
        self.options = {}
        for spec in config.getoption("onnx_runtime_provider_options"):
            key, sep, value = spec.partition("=")
            if not sep or not key:
                raise pytest.UsageError(f"--provider-option expects KEY=VALUE, got {spec!r}")
            self.options[key] = value
        fallback = config.getoption("onnx_runtime_fallback")
        if fallback is None:
            fallback = "CPUExecutionProvider" if registry().find("CPUExecutionProvider") else "none"
        self.fallback = None if fallback.lower() == "none" or registry().find(fallback) is self.entry else fallback
        paths = [config.getoption("onnx_runtime_exclusions")] if config.getoption("onnx_runtime_exclusions") else []
        paths += [str(p) for p in config.getini("onnx_runtime_backend_exclusions")]
        self.exclusions = {}
        for path in paths:
            self.exclusions.update(cases.read_listing(os.fspath(path)))
        self.tally: dict[str, Counter] = {kind: Counter() for kind in LABELS}

    def require_available(self) -> None:
        availability = self.entry.availability
        if not availability.available:
            pytest.skip(f"{self.name} is unavailable here: {availability.reason}")

    def handle(self):
        handle = self.entry.create()
        handle.initialize(dict(self.options))
        return handle

    def run(self, model, data_sets, rtol: float, atol: float, name: str) -> None:
        """One backend case: skipped when excluded or declined, else compared."""
        if name in self.exclusions:
            pytest.skip(f"excluded: {self.exclusions[name]}")
        self.require_available()
        try:
            cases.run_case(model, data_sets, rtol, atol, self.name, self.fallback, self.options)
        except cases.Declined as declined:
            pytest.skip(str(declined))


_TARGET = pytest.StashKey[Target]()


def pytest_configure(config) -> None:
    config.stash[_TARGET] = Target(config)
    config.addinivalue_line("markers", "onnx_runtime_backend: a case of onnx_runtime.testing's backend suite")


def pytest_generate_tests(metafunc) -> None:
    target = metafunc.config.stash[_TARGET]
    if NODE in metafunc.fixturenames:
        metafunc.parametrize(NODE, sorted(cases.node_cases()))
    if MODEL in metafunc.fixturenames:
        metafunc.parametrize(MODEL, sorted(cases.model_set_dirs()))
    if CONTRACT in metafunc.fixturenames:
        metafunc.parametrize(CONTRACT, contract_checks.implemented_hooks(target.entry.create()))


@pytest.fixture(scope="session")
def onnx_runtime_target(pytestconfig) -> Target:
    """The provider under test: ``name``, ``options``, ``fallback``, ``exclusions``, ``run(...)``."""
    return pytestconfig.stash[_TARGET]


@pytest.fixture(scope="session")
def provider_name(onnx_runtime_target) -> str:
    """The provider under test's full name (``--provider`` accepts the short name too); skips when unavailable."""
    onnx_runtime_target.require_available()
    return onnx_runtime_target.name


@pytest.fixture(scope="session")
def provider_options(onnx_runtime_target) -> dict:
    """The ``--provider-option`` values, as a session takes them."""
    return dict(onnx_runtime_target.options)


@pytest.fixture
def provider_handle(provider_name, onnx_runtime_target):
    """A fresh, initialized ``ProviderHandle`` of the provider under test, shut down afterwards."""
    handle = onnx_runtime_target.handle()
    yield handle
    handle.shutdown()


@pytest.fixture
def session_factory(provider_name, onnx_runtime_target):
    """``session_factory(model, fallback=False, options=None)``: an ``InferenceSession`` on the provider under
    test (with its options), the fallback provider listed after it when ``fallback`` is true; closed afterwards.
    ``model`` is a path, bytes or a ``ModelProto``. Strict kernels are on (session/strict.py) unless ``options``
    sets ``session.strict_kernels`` itself."""
    from ..errors import ConfigEntryNotSetError
    from ..session import InferenceSession, SessionOptions

    made = []

    def make(model, fallback: bool = False, options=None):
        if hasattr(model, "SerializeToString"):
            model = model.SerializeToString()
        options = options if options is not None else SessionOptions()
        try:
            options.get_session_config_entry(cases.STRICT_KERNELS)
        except ConfigEntryNotSetError:  # not set by the test: strict
            options.add_session_config_entry(cases.STRICT_KERNELS, "1")
        providers: list = [(provider_name, dict(onnx_runtime_target.options))]
        if fallback and onnx_runtime_target.fallback:
            providers.append(onnx_runtime_target.fallback)
        session = InferenceSession(model, options, providers=providers)
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


@pytest.fixture
def assert_runs_on_provider(provider_name):
    """``assert_runs_on_provider(session)``: every node of the session is placed on the provider under test;
    raises ``Declined`` (with the provider's reasons) or ``SilentFallback`` otherwise."""
    return lambda session: cases.check_placement(session, provider_name)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        kind = next((k for k in LABELS if k in params), None)
        if kind is not None:
            item.add_marker(pytest.mark.onnx_runtime_backend)
            item.stash[_KIND] = kind


_KIND = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    kind = item.stash.get(_KIND, None)
    if kind is not None:
        report.user_properties.append(("onnx_runtime_kind", kind))
    return report


def pytest_runtest_logreport(report) -> None:
    kind = dict(report.user_properties).get("onnx_runtime_kind")
    if kind is None:
        return
    tally = _current_tally()
    if tally is None:
        return
    if report.failed:
        tally[kind]["failed"] += 1
    elif report.skipped:
        message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcome = "declined" if "declined by " in message else "excluded" if "excluded: " in message else "skipped"
        tally[kind][outcome] += 1
    elif report.when == "call":
        tally[kind]["passed"] += 1


_RUN: dict = {}


def pytest_sessionstart(session) -> None:
    _RUN["tally"] = session.config.stash[_TARGET].tally


def _current_tally():
    return _RUN.get("tally")


def summary_line(target: Target) -> str:
    """``onnx_runtime.testing: NAME: backend node cases 1866 passed, 0 declined, 0 failed, 18 excluded; ...``"""
    parts = []
    for kind, label in LABELS.items():
        counts = target.tally[kind]
        if counts:
            shown = ", ".join(f"{counts[o]} {o}" for o in ("passed", "declined", "failed", "excluded", "skipped")
                              if counts[o] or o in ("passed", "declined", "failed"))
            parts.append(f"{label} {shown}")
    return f"onnx_runtime.testing: {target.name}: " + ("; ".join(parts) or "no backend cases or contract checks ran")


def pytest_terminal_summary(terminalreporter, config) -> None:
    terminalreporter.write_line(summary_line(config.stash[_TARGET]))
