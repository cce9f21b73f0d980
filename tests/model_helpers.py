"""Helpers shared by the tests: tiny ONNX models built in code, and the onnx package's shipped models."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.contract.markers import hookimpl

ROOT = Path(__file__).resolve().parents[1]
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT_MODELS = sorted(f[:-5] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx"))


def light_model(name: str) -> tuple[onnx.ModelProto, str, list[int]]:
    """One of the onnx wheel's light CNNs: (model, its data input's name, that input's shape)."""
    model = onnx.load(os.path.join(LIGHT_DIR, f"{name}.onnx"))
    initializers = {i.name for i in model.graph.initializer}
    (data,) = [i for i in model.graph.input if i.name not in initializers]
    return model, data.name, [d.dim_value for d in data.type.tensor_type.shape.dim]


def with_softmax_logits(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """A copy of ``model`` that also outputs its closing Softmax's input, and that input's name."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    (softmax,) = [node for node in model.graph.node if node.op_type == "Softmax"]
    model.graph.output.append(helper.make_tensor_value_info(softmax.input[0], TensorProto.FLOAT, None))
    return model, softmax.input[0]


def record_calls(monkeypatch, cls) -> list:
    """The instances of ``cls`` called from now on (this test), one entry per call: its __call__ patched
    to note ``self`` and go on."""
    calls = []
    real = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *args: calls.append(self) or real(self, *args))
    return calls


def record_results(monkeypatch, cls, name: str) -> list:
    """The results of method ``name`` of ``cls`` from now on (this test), in call order: the method patched
    to note each result and return it."""
    results = []
    real = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *args: results.append(real(self, *args)) or results[-1])
    return results


def tensor_info(name, elem=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, **kwargs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test_graph", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)
    model.ir_version = 8
    return model


def chain_reference(x: np.ndarray) -> np.ndarray:
    b = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    a = np.maximum(x, 0) + b
    e = np.exp(a - a.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) * x


class CopyCounter:
    """Counts the copies the given provider handles perform: host to device (uploads), device to host
    (downloads) and device to device."""

    def __init__(self, *handles):
        self.uploads = self.downloads = self.device_copies = 0
        for handle in handles:
            handle.pm.register(self, name=f"copy-counter-{id(self)}-{id(handle)}")

    @property
    def host_copies(self) -> int:
        return self.uploads + self.downloads

    @hookimpl(wrapper=True)
    def copy_from_host(self):
        self.uploads += 1
        return (yield)

    @hookimpl(wrapper=True)
    def copy_to_host(self):
        self.downloads += 1
        return (yield)

    @hookimpl(wrapper=True)
    def copy(self):
        self.device_copies += 1
        return (yield)

    def per_call(self, call) -> tuple[int, int, int]:
        """(uploads, downloads, device copies) of one ``call()``."""
        before = (self.uploads, self.downloads, self.device_copies)
        call()
        return tuple(now - then for now, then in zip((self.uploads, self.downloads, self.device_copies), before))


@contextlib.contextmanager
def qdq_epilogues_without(*names: str):
    """The CPU provider's QDQ epilogue passes without the ones named, for the graph a fold would leave (the unfolded
    values a test compares with); the list is restored on leaving."""
    from onnx_runtime_ep_cpu import provider

    saved = provider.QDQ_EPILOGUE_PASSES
    provider.QDQ_EPILOGUE_PASSES = [p for p in saved if p.__name__ not in names]
    try:
        yield
    finally:
        provider.QDQ_EPILOGUE_PASSES = saved


def decode_concat_model() -> bytes:
    """present = Concat(past, x) over the sequence; y = x + sum(present) over it, through an Expand whose
    target the graph computes from Shape(x) (what exporters write)."""
    nodes = [
        helper.make_node("Concat", ["past", "x"], ["present"], axis=1),
        helper.make_node("ReduceSum", ["present", "axis"], ["total"], keepdims=1),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["total", "shape"], ["spread"]),
        helper.make_node("Add", ["x", "spread"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", TensorProto.FLOAT, [1, "seq", 4]), tensor_info("past", TensorProto.FLOAT, [1, "past", 4])],
        [tensor_info("y", TensorProto.FLOAT, None), tensor_info("present", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([1], np.int64), "axis")])
    return model.SerializeToString()


def ops_and_outputs(model: onnx.ModelProto, feeds: dict) -> tuple[list[str], list[np.ndarray]]:
    """Our session's outputs for ``feeds`` at its second run (a specialized plan's, where the passes have fired)
    and the op types of the graph that ran them."""
    import onnx_runtime

    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    session.run(None, feeds)
    outputs = session.run(None, feeds)
    return [n.op_type for n in session.graph_for(feeds).nodes], outputs


def oracle_session(model: onnx.ModelProto):
    """onnxruntime's CPU session of ``model``, quiet (the oracle); skips the test when onnxruntime is missing."""
    import pytest

    onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def read_only(value, dtype) -> np.ndarray:
    """``value`` as an array of ``dtype`` that cannot be written, as initializers are."""
    array = np.array(value, dtype)
    array.flags.writeable = False
    return array


def zoo_manifest() -> Path:
    """The model zoo's manifest.json (ONNX_RUNTIME_ZOO or benchmarks/.models/zoo); skips the calling test module
    when the zoo is not built."""
    import pytest

    zoo = Path(os.environ.get("ONNX_RUNTIME_ZOO") or ROOT / "benchmarks/.models/zoo")
    manifest = zoo / "manifest.json"
    if not manifest.is_file():
        pytest.skip(f"the model zoo is not built ({manifest} is missing): run scripts/build_zoo.sh",
                    allow_module_level=True)
    return manifest


def json_from_child(script: str, *args, env: dict | None = None, timeout: float = 600):
    """The JSON on the last line ``python -c script args`` prints in a fresh process (``env``, else ours); the
    process must succeed."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def mul_relu_batch_model() -> bytes:
    """Y = Relu(X * W), X of a symbolic batch: each batch size is its own plan (signature)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Z"]), helper.make_node("Relu", ["Z"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("W", TensorProto.FLOAT, [4], [0.5, -1.0, 2.0, 3.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def zoo_model(name: str) -> tuple[dict, str]:
    """(manifest entry, path) of the model zoo's model ``name``, with benchmarks/ on sys.path (zoo_feeds); skips
    the test when the zoo lacks the model."""
    import pytest

    zoo = ROOT / "benchmarks" / ".models" / "zoo"
    path = zoo / f"{name}.onnx"
    if not path.is_file():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    entry = next(m for m in json.loads((zoo / "manifest.json").read_text())["models"] if m["name"] == name)
    return entry, str(path)


def holdout_planned_ops(name: str) -> dict[str, list[str]]:
    """The op types of our specialized plan for each call (prefill, decode) of the holdout model ``name``
    (benchmarks/.models/holdout), each call run once first; skips the test when the holdout set is not built."""
    import onnx_runtime
    import pytest

    holdout = ROOT / "benchmarks" / ".models" / "holdout"
    if not (holdout / "manifest.json").is_file():
        pytest.skip("the holdout set is not built: run benchmarks/zoo.py --holdout")
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo_feeds import make_feeds

    entry = next(m for m in json.loads((holdout / "manifest.json").read_text())["models"] if m["name"] == name)
    session = onnx_runtime.InferenceSession(str(holdout / entry["file"]), providers=["CPUExecutionProvider"])
    planned = {}
    for call in ("prefill", "decode"):
        feeds = make_feeds(entry["calls"][call])
        session.run(None, feeds)
        planned[call] = [node.op_type for node in session.graph_for(feeds).nodes]
    return planned


def qdq_zoo_sessions(qdq_decoders, name: str, without: str) -> tuple:
    """For the QDQ zoo decoder ``name`` of the qdq_decoders fixture: (its call specs, onnxruntime's session, the
    oracle (skips when onnxruntime is missing), ours, ours made without the QDQ epilogue pass ``without``)."""
    import onnx_runtime
    import pytest

    built, entries, _ = qdq_decoders
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    path = str(built[name])
    theirs = oracle.InferenceSession(path, providers=["CPUExecutionProvider"])
    ours = onnx_runtime.InferenceSession(path, providers=["cpu"])
    with qdq_epilogues_without(without):
        plain = onnx_runtime.InferenceSession(path, providers=["cpu"])
    return entries[name + ".fp32"]["calls"], theirs, ours, plain


def saved_for_child(folder, model: onnx.ModelProto, x: np.ndarray, stem: str) -> tuple:
    """(model path, input path): ``model`` saved as ``stem``.onnx and ``x`` as x.npy in ``folder``, for a fresh
    process to read."""
    model_path, x_path = folder / f"{stem}.onnx", folder / "x.npy"
    onnx.save(model, model_path)
    np.save(x_path, x)
    return model_path, x_path


def within_limit(action, lock, limit_s: float, what: str) -> None:
    """Run ``action`` on a daemon thread and fail, rather than hang, when it has not returned within ``limit_s``:
    ``lock`` (a plain lock the stuck thread would hold and wait for) is released so the teardown does not hang too.
    An exception ``action`` raised is raised here."""
    import pytest

    failures, finished = [], threading.Event()

    def run():
        try:
            action()
        except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
            failures.append(error)
        finally:
            finished.set()

    threading.Thread(target=run, daemon=True).start()
    if not finished.wait(limit_s):
        with contextlib.suppress(RuntimeError):
            lock.release()
        finished.wait(limit_s)
        pytest.fail(f"{what} did not return within {limit_s} s")
    if failures:
        raise failures[0]


def session_without_passes(model, monkeypatch, list_name: str, *names: str):
    """A CPU session of ``model`` created while the CPU provider's pass list ``list_name`` ("QDQ_PASSES", ...) lacks
    the passes ``names``: the control of a test of those passes (the list is restored at once)."""
    import onnx_runtime
    from onnx_runtime_ep_cpu import provider

    with monkeypatch.context() as patch:
        kept = [p for p in getattr(provider, list_name) if p.__name__ not in names]
        patch.setattr(provider, list_name, kept, raising=False)
        return onnx_runtime.InferenceSession(model, providers=["cpu"])


def logical_shape_checks(monkeypatch) -> list:
    """The labels of the device bindings whose logical shape is set through the checked path
    (DeviceIoBinding.set_logical_shape) from now on, in order."""
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    checked: list = []
    set_logical_shape = DeviceIoBinding.set_logical_shape

    def counting(self, shape):
        checked.append(self.label)
        return set_logical_shape(self, shape)

    monkeypatch.setattr(DeviceIoBinding, "set_logical_shape", counting)
    return checked


def bound_plan(plan):
    """A segment's BoundPlan: ``plan`` itself, or the first image range's where the batch is split across threads
    (algorithms/segment_split.SplitPlan, whose ranges are planned alike)."""
    return plan.parts[0] if hasattr(plan, "parts") else plan
