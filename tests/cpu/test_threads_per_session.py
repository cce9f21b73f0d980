"""intra_op_num_threads belongs to its session: two sessions of one process with different counts each run
with their own, whichever was created last, also when two Python threads run them at the same time; numpy's
BLAS pool is sized per run; outside a run the default applies."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.cpus import usable_cpus
from onnx_runtime_ep_cpu import registry, threads
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.compiled import workers  # imports numba: no background loading in this process

DOMAIN = "test.threads_per_session"
DEFAULT = usable_cpus()  # a session's count by default
TWO = min(2, DEFAULT)  # what a session asking for two threads gets here
needs_two_cpus = pytest.mark.skipif(DEFAULT < 2, reason="one usable CPU: every session runs on one")


class _Probe:
    """What the probe operator's kernel saw in each call: (session tag, kernel_threads(), BLAS pool size)."""

    def __init__(self):
        self.seen: list[tuple[str, int, int | None]] = []
        self.barrier: threading.Barrier | None = None  # set: each call waits for the other thread's call
        self.lock = threading.Lock()

    def factory(self, node, shapes, opset):
        tag = node.attr("tag", b"")
        tag = tag.decode() if isinstance(tag, bytes) else str(tag)

        def kernel(x):
            if self.barrier is not None:  # both runs are inside their scopes now
                self.barrier.wait(timeout=30)
            with self.lock:
                self.seen.append((tag, threads.kernel_threads(), _openblas_threads()))
            return (x,)

        return kernel


def _openblas_threads() -> int | None:
    """numpy's bundled OpenBLAS's current pool size (None where numpy bundles none)."""
    for _, library in threads.bundled_openblas():
        for name in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                     "openblas_get_num_threads64_", "openblas_get_num_threads"):
            getter = getattr(library, name, None)
            if getter is not None:
                getter.restype = ctypes.c_int
                return int(getter())
    return None


@pytest.fixture
def probe():
    """The probe operator registered in a test domain for this test, then removed."""
    found = _Probe()
    registry.register("Probe", domain=DOMAIN)(found.factory)
    try:
        yield found
    finally:
        registry._REGISTRY.pop((DOMAIN, "Probe"), None)  # noqa: SLF001  (no public way to unregister)
        registry.REGISTERED_IN.pop((DOMAIN, "Probe", 1), None)


def _model(tag: str, rows: int = 4, depth: int = 32) -> bytes:
    """z = Probe(x @ W) with a constant W (depth, depth): a product the packed kernels split across threads
    once it is large enough."""
    w = (np.random.default_rng(7).standard_normal((depth, depth)) / np.sqrt(depth)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="product"),
             helper.make_node("Probe", ["y"], ["z"], name="probe", domain=DOMAIN, tag=tag)]
    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, depth])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [rows, depth])],
                              [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def _session(model: bytes, count: int, **settings) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = count
    for key, value in settings.items():
        setattr(options, key, value)
    return ort.InferenceSession(model, options, providers=["cpu"])


def _reference(x: np.ndarray, model: bytes) -> np.ndarray:
    w = numpy_helper.to_array(onnx.load_from_string(model).graph.initializer[0]).astype(np.float64)
    return x.astype(np.float64) @ w


@pytest.mark.parametrize("one_first", [True, False], ids=["one-thread session first", "two-thread session first"])
def test_each_session_runs_with_its_own_count(probe, one_first):
    one, two = _model("one"), _model("two")
    if one_first:
        a, b = _session(one, 1), _session(two, 2)
    else:
        b, a = _session(two, 2), _session(one, 1)
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    outputs = [a.run(None, {"x": x})[0], b.run(None, {"x": x})[0], a.run(None, {"x": x})[0]]
    assert [seen[:2] for seen in probe.seen] == [("one", 1), ("two", TWO), ("one", 1)]
    for y in outputs:
        assert np.max(np.abs(y - _reference(x, one))) < 1e-4
    assert threads.kernel_threads() == DEFAULT  # outside a run: the default, nothing left set


def test_default_and_deterministic_sessions(probe):
    default = _session(_model("default"), 0)
    deterministic = _session(_model("deterministic"), 2, use_deterministic_compute=True)
    x = np.ones((4, 32), np.float32)
    default.run(None, {"x": x})
    deterministic.run(None, {"x": x})
    default.run(None, {"x": x})
    assert [seen[:2] for seen in probe.seen] == [("default", DEFAULT), ("deterministic", 1),
                                                ("default", DEFAULT)]


def test_concurrent_runs_from_two_threads_each_see_their_own(probe):
    sessions = {"one": _session(_model("one"), 1), "two": _session(_model("two"), 2)}
    probe.barrier = threading.Barrier(2)  # every probe call meets the other thread's: the runs overlap
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    results: dict[str, list] = {"one": [], "two": []}
    failures: list[BaseException] = []

    def work(tag: str) -> None:
        try:
            for _ in range(20):
                results[tag].append(sessions[tag].run(None, {"x": x})[0])
        except BaseException as exc:  # reported below, on the test's thread
            failures.append(exc)
            probe.barrier.abort()

    workers_ = [threading.Thread(target=work, args=(tag,)) for tag in sessions]
    for thread in workers_:
        thread.start()
    for thread in workers_:
        thread.join(60)
    assert not failures, failures
    counts = {tag: {seen[1] for seen in probe.seen if seen[0] == tag} for tag in sessions}
    assert counts == {"one": {1}, "two": {TWO}}
    assert len(probe.seen) == 40
    expected = _reference(x, _model("one"))
    for outputs in results.values():
        assert len(outputs) == 20
        for y in outputs:
            assert np.max(np.abs(y - expected)) < 1e-4


@needs_two_cpus
def test_blas_pool_is_set_per_run(probe, knobs):
    if _openblas_threads() is None:
        pytest.skip("numpy bundles no OpenBLAS")
    one, two = _session(_model("one"), 1), _session(_model("two"), 2)
    knobs(blas_threads=2)  # a pool above one thread: the one-thread session must still run BLAS on one
    x = np.ones((4, 32), np.float32)
    for _ in range(2):
        two.run(None, {"x": x})
        one.run(None, {"x": x})
    assert [(tag, pool) for tag, _, pool in probe.seen] == [("two", 2), ("one", 1)] * 2


@needs_two_cpus
@pytest.mark.skipif(not gemv_host(), reason="the packed products and their helper threads need AVX-512")
def test_helpers_take_work_only_for_the_session_that_has_them(probe, knobs):
    knobs(split_macs=1 << 16)  # a product of this size splits across every thread the run has
    rows, depth = 256, 256
    one, two = _session(_model("one", rows, depth), 1), _session(_model("two", rows, depth), 2)
    x = np.random.default_rng(2).standard_normal((rows, depth)).astype(np.float32)
    expected = _reference(x, _model("one", rows, depth))

    def posted_during(session) -> int:
        pool = workers.helpers(threads.helper_count())
        before = int(pool.mailboxes[:, workers.POSTED].sum())
        for _ in range(30):  # a sleeping helper is woken for later calls, not the one that found it asleep
            y = session.run(None, {"x": x})[0]
            assert np.max(np.abs(y - expected)) < 1e-3
        return int(pool.mailboxes[:, workers.POSTED].sum()) - before

    assert posted_during(two) > 0
    assert posted_during(one) == 0
    assert posted_during(two) > 0
