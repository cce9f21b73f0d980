"""The onnxruntime API as scripts use it, run against onnxruntime and this project on the same models: each usage
is a function of the runtime module whose result (a value, or the class names of what it raised) must be the same
for both. A drift in either runtime's behaviour fails here. Where this project deliberately differs, the
difference is in docs/differences-from-onnxruntime.md and is tested on its own below the shared usages."""

from __future__ import annotations

import json
import threading
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
import onnx_runtime  # noqa: E402

RUNTIMES = {"onnxruntime": ort, "onnx_runtime": onnx_runtime}


def _model(nodes, inputs, outputs, opset=17, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


RELU = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])])
PADDLE_DIMS = _model([helper.make_node("Relu", ["x"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 3, -1])])
RESHAPE = _model([helper.make_node("Reshape", ["x", "s"], ["y"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                  helper.make_tensor_value_info("s", TensorProto.INT64, [1])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
UNKNOWN_OP = _model([helper.make_node("NoSuchOperator", ["x"], ["y"])],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
X = np.array([[-1.0, 0.5, 2.0], [3.0, -4.0, 0.0]], np.float32)


def _session(rt, model=RELU, options=None, providers=("CPUExecutionProvider",)):
    return rt.InferenceSession(model, options, providers=list(providers))


def _raised(call) -> tuple[str, ...]:
    """The onnxruntime class (under capi.onnxruntime_pybind11_state) and built-in bases the call raised."""
    try:
        call()
    except Exception as exc:  # what was raised is the result
        kinds = {cls.__name__ for cls in type(exc).__mro__ if cls.__module__.endswith("onnxruntime_pybind11_state")}
        builtins = {cls.__name__ for cls in (ValueError, TypeError, RuntimeError, AttributeError, FileNotFoundError)
                    if isinstance(exc, cls)}
        return tuple(sorted(kinds | builtins)) or (type(exc).__name__,)
    return ("no error",)


def _errors(rt, tmp_path):
    sess = _session(rt)
    reshape = _session(rt, RESHAPE)
    return {
        "missing file": _raised(lambda: rt.InferenceSession(str(tmp_path / "none.onnx"))),
        "garbage bytes": _raised(lambda: rt.InferenceSession(b"\x08\x07 not a model at all")),
        "wrong dtype": _raised(lambda: sess.run(None, {"x": X.astype(np.float64)})),
        "wrong rank": _raised(lambda: sess.run(None, {"x": X[0]})),
        "unknown output": _raised(lambda: sess.run(["nope"], {"x": X})),
        "missing input": _raised(lambda: sess.run(None, {})),
        "kernel failure": _raised(lambda: reshape.run(None, {"x": np.zeros(2, np.float32),
                                                             "s": np.array([3], np.int64)})),
        "misspelled option": _raised(lambda: setattr(rt.SessionOptions(), "intra_op_num_thread", 1)),
        "level out of range": _raised(lambda: setattr(rt.SessionOptions(), "graph_optimization_level", 42)),
        "unset session entry": _raised(lambda: rt.SessionOptions().get_session_config_entry("no.such.key")),
        "unset run entry": _raised(lambda: rt.RunOptions().get_run_config_entry("no.such.key")),
    }


def _api(rt, tmp_path):
    sess = _session(rt)
    value = rt.OrtValue.ortvalue_from_numpy(X)
    run_options = rt.RunOptions()
    run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    options = rt.SessionOptions()
    options.add_free_dimension_override_by_name("batch", 2)
    fixed = _session(rt, options=options)
    paddle = _session(rt, PADDLE_DIMS)
    outputs = sess.run_with_ort_values(None, {"x": value})
    done = threading.Event()
    answer: dict = {}

    def callback(results, user_data, error):
        answer.update(results=[np.asarray(r).tolist() for r in results], user_data=user_data, error=error)
        done.set()

    sess.run_async(None, {"x": X}, callback, "mine")
    assert done.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fallback = _session(rt, providers=("TensorrtExecutionProvider", "CPUExecutionProvider"))
    with_options = rt.InferenceSession(RELU, providers=[("CPUExecutionProvider",
                                                         {"arena_extend_strategy": "kSameAsRequested"})])
    sess.set_providers(["CPUExecutionProvider"])
    return {
        "levels": {name: int(level) for name, level in rt.GraphOptimizationLevel.__members__.items()},
        "orders": {name: int(order) for name, order in rt.ExecutionOrder.__members__.items()},
        "modes": {name: int(mode) for name, mode in rt.ExecutionMode.__members__.items()},
        "inputs": [(a.name, a.type, a.shape) for a in sess.get_inputs()],
        "version is text": isinstance(rt.get_version_string(), str),
        "ortvalue": (value.element_type(), value.data_type(), value.shape(), value.is_tensor(),
                     value.is_sparse_tensor(), value.is_tensor_sequence(), value.tensor_size_in_bytes()),
        "ortvalue feed": sess.run(None, {"x": value})[0].tolist(),
        "run_with_ort_values": [(type(o).__name__, o.numpy().tolist()) for o in outputs],
        "run config": run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage"),
        "free dimension override": [a.shape for a in fixed.get_inputs()],
        "paddle -1 dims": ([a.shape for a in paddle.get_inputs()],
                           paddle.run(None, {"x": np.ones((2, 3, 5), np.float32)})[0].shape),
        "run_async": answer,
        "unknown provider skipped": fallback.get_providers()[-1:],
        "cpu provider options": with_options.run(None, {"x": X})[0].tolist(),
        "set_providers": (sess.get_providers()[-1:], sess.run(None, {"x": X})[0].tolist()),
        "profiling off": sess.end_profiling(),
        "custom ops library": _raised(lambda: rt.SessionOptions().register_custom_ops_library(
            str(tmp_path / "libcustom.so"))) != ("no error",),
    }


def _profile(rt, tmp_path):
    options = rt.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / rt.__name__)
    sess = _session(rt, options=options)
    sess.run(None, {"x": X})
    events = json.loads(open(sess.end_profiling()).read())
    node = next(e for e in events if e["cat"] == "Node")
    return {
        "keys": sorted({key for e in events for key in e}),
        "phases": sorted({e["ph"] for e in events}),
        "session events": sorted({e["name"] for e in events if e["cat"] == "Session"}
                                 & {"model_loading_array", "session_initialization", "model_run"}),
        "node": (node["name"], node["args"]["op_name"], node["args"]["provider"], node["args"]["input_type_shape"],
                 node["args"]["output_type_shape"]),
    }


def _optimized_file(rt, tmp_path):
    options = rt.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / f"{rt.__name__}.onnx")
    _session(rt, options=options)
    written = onnx.load(options.optimized_model_filepath)
    return [n.op_type for n in written.graph.node]


def test_what_onnxruntime_raises_is_what_catches_ours(tmp_path):
    """Each error here is of the class onnxruntime raises in the same situation (and the built-in it is); it may
    be of more (the project's own typed error, a second onnxruntime class that also fits), never of fewer."""
    want, got = _errors(ort, tmp_path), _errors(onnx_runtime, tmp_path)
    differ = {key: (want[key], got[key]) for key in want if not set(want[key]) <= set(got[key])}
    assert not differ, "\n".join(f"{k}: onnxruntime {w!r}, ours {g!r}" for k, (w, g) in differ.items())


@pytest.mark.parametrize("usage", [_api, _profile, _optimized_file], ids=lambda f: f.__name__.strip("_"))
def test_the_same_usage_behaves_the_same(usage, tmp_path):
    results = {name: usage(rt, tmp_path) for name, rt in RUNTIMES.items()}
    want, got = results["onnxruntime"], results["onnx_runtime"]
    if isinstance(want, dict):
        differ = {key: (want[key], got.get(key)) for key in want if want[key] != got.get(key)}
        assert not differ, "onnxruntime vs onnx_runtime:\n" + "\n".join(f"{k}: {w!r} vs {g!r}"
                                                                        for k, (w, g) in differ.items())
    else:
        assert got == want


def test_an_unknown_operator_is_both_of_onnxruntimes_classes():
    """onnxruntime raises InvalidGraph for an operator no schema defines and NotImplemented for one no kernel runs;
    here one error is both, so either ``except`` catches it."""
    state = onnx_runtime.capi.onnxruntime_pybind11_state
    with pytest.raises(state.InvalidGraph) as raised:
        onnx_runtime.InferenceSession(UNKNOWN_OP, providers=["CPUExecutionProvider"])
    assert isinstance(raised.value, state.NotImplemented)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidGraph):
        ort.InferenceSession(UNKNOWN_OP, providers=["CPUExecutionProvider"])


def test_logging_goes_through_python_logging_with_the_session_logid(caplog):
    options = onnx_runtime.SessionOptions()
    options.log_severity_level = 0
    options.logid = "compat-check"
    with caplog.at_level("DEBUG", logger="onnx_runtime"):
        _session(onnx_runtime, options=options).run(None, {"x": X})
    messages = [r.getMessage() for r in caplog.records if r.name == "onnx_runtime"]
    assert any("[compat-check] created from model" in m for m in messages)
    assert any("[compat-check] node 'relu' (Relu) runs on CPUExecutionProvider" in m for m in messages)
    assert any("[compat-check] run:" in m for m in messages)
    caplog.clear()
    quiet = onnx_runtime.SessionOptions()
    quiet.logid = "quiet"
    with caplog.at_level("DEBUG", logger="onnx_runtime"):
        _session(onnx_runtime, options=quiet).run(None, {"x": X})
    assert not [r for r in caplog.records if "[quiet]" in r.getMessage()]  # severity 2: nothing at creation


def test_nothing_runnable_falls_back_to_cpu_only_when_asked():
    """A deliberate difference: asking only for a provider that cannot run raises, unless the session asks for
    onnxruntime's fallback to the CPU provider."""
    with pytest.raises(onnx_runtime.capi.onnxruntime_pybind11_state.EPFail, match="provider_fallback"):
        _session(onnx_runtime, providers=("TensorrtExecutionProvider", "MIGraphXExecutionProvider"))
    options = onnx_runtime.SessionOptions()
    options.add_session_config_entry("session.provider_fallback", "1")
    with pytest.warns(RuntimeWarning, match="falling back to CPUExecutionProvider"):
        sess = _session(onnx_runtime, options=options, providers=("TensorrtExecutionProvider",))
    assert sess.get_providers() == ["CPUExecutionProvider"]
