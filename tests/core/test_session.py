"""InferenceSession: the onnxruntime API shape, output subsets, and typed feed errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import chain_reference, make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError, KernelError, OnnxRuntimeError


@pytest.fixture
def two_output_model():
    nodes = [
        helper.make_node("Add", ["x", "y"], ["sum"], name="add"),
        helper.make_node("Mul", ["x", "y"], ["prod"], name="mul"),
        helper.make_node("Shape", ["x"], ["xshape"], name="shape"),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", shape=["batch", 3]), tensor_info("y", shape=[1, 3])],
        [
            tensor_info("sum", shape=["batch", 3]),
            tensor_info("prod", shape=["batch", 3]),
            tensor_info("xshape", TensorProto.INT64, [2]),
        ],
        producer_name="unit-test",
        doc_string="two outputs",
    )
    model.metadata_props.add(key="author", value="tests")
    model.graph.doc_string = "graph doc"
    return model


def _feeds(batch=2):
    return {"x": np.arange(batch * 3, dtype=np.float32).reshape(batch, 3), "y": np.array([[1, 2, 3]], np.float32)}


def test_inputs_outputs_and_metadata_look_like_onnxruntime(two_output_model):
    sess = ort.InferenceSession(two_output_model.SerializeToString(), providers=["CPUExecutionProvider"])
    inputs = sess.get_inputs()
    assert [(i.name, i.type, i.shape) for i in inputs] == [
        ("x", "tensor(float)", ["batch", 3]),
        ("y", "tensor(float)", [1, 3]),
    ]
    assert [(o.name, o.type) for o in sess.get_outputs()] == [
        ("sum", "tensor(float)"),
        ("prod", "tensor(float)"),
        ("xshape", "tensor(int64)"),
    ]
    meta = sess.get_modelmeta()
    assert (meta.producer_name, meta.description, meta.graph_name, meta.graph_description) == (
        "unit-test",
        "two outputs",
        "test_graph",
        "graph doc",
    )
    assert meta.custom_metadata_map == {"author": "tests"}
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert sess.get_provider_options() == {"CPUExecutionProvider": {}}


def test_run_all_outputs_and_subsets_with_dynamic_batch(two_output_model):
    sess = ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"])
    for batch in (2, 5):
        feeds = _feeds(batch)
        total, product, shape = sess.run(None, feeds)
        np.testing.assert_array_equal(total, feeds["x"] + feeds["y"])
        np.testing.assert_array_equal(product, feeds["x"] * feeds["y"])
        assert shape.dtype == np.int64 and shape.tolist() == [batch, 3]
    (only_prod,) = sess.run(["prod"], _feeds())
    np.testing.assert_array_equal(only_prod, _feeds()["x"] * _feeds()["y"])
    shape, total = sess.run(["xshape", "sum"], _feeds())
    assert shape.tolist() == [2, 3] and total.shape == (2, 3)


def test_a_subset_of_outputs_runs_only_the_nodes_it_needs():
    # The Clip omits its min input ("") and the Dropout omits its mask output (""): an omitted input
    # names no value, so it must not pull in the Dropout, whose omitted output is also "".
    nodes = [
        helper.make_node("Dropout", ["x"], ["dropped", ""], name="dropout"),
        helper.make_node("Clip", ["x", "", "high"], ["clipped"], name="clip"),
        helper.make_node("Neg", ["clipped"], ["negated"], name="neg"),
    ]
    high = helper.make_tensor("high", TensorProto.FLOAT, [], [1.0])
    model = make_model(
        nodes, [tensor_info("x", shape=[2, 3])],
        [tensor_info("negated", shape=[2, 3]), tensor_info("dropped", shape=[2, 3])], [high],
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"], disabled_optimizers=["*"])
    x = np.array([[-2, 0.5, 3], [1, 2, -1]], np.float32)
    (negated,) = sess.run(["negated"], {"x": x})
    np.testing.assert_array_equal(negated, -np.minimum(x, 1.0))
    steps = sess._executor.plan(("negated",)).steps
    assert [step.node.name for step in steps] == ["clip", "neg"]
    assert [step.node.name for step in sess._executor.plan(("dropped",)).steps] == ["dropout"]


def test_session_from_path_bytes_and_proto_agree(tmp_path, chain_model):
    path = tmp_path / "chain.onnx"
    onnx.save(chain_model, path)
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    for source in (str(path), path.read_bytes(), chain_model):
        (y,) = ort.InferenceSession(source, providers=["cpu"]).run(None, {"x": x})
        np.testing.assert_allclose(y, chain_reference(x), rtol=1e-5)


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        (
            {"x": np.zeros((2, 3), np.float32)},
            r"missing inputs 'y' \(tensor\(float\)\[1, 3\]\); add them to input_feed",
        ),
        ({**_feeds(), "z": np.zeros(1)}, r"unknown input 'z'; the model's inputs are \['x', 'y'\]"),
        (
            {**_feeds(), "y": np.zeros((1, 3), np.float64)},
            r"input 'y' expects tensor\(double\)|input 'y' expects tensor\(float\), got float64 array; convert it with "
            r"\.astype\(np\.float32\)",
        ),
        ({**_feeds(), "y": np.zeros((3,), np.float32)}, r"input 'y' expects rank 2 .*got shape \[3\]"),
        ({**_feeds(), "y": np.zeros((1, 4), np.float32)}, r"input 'y' dimension 1 must be 3 .*got shape \[1, 4\]"),
        ({**_feeds(), "x": "not an array"}, r"input 'x' expects tensor\(float\)"),
        ({**_feeds(), "x": object()}, r"input 'x' must be a numpy array, got object"),
    ],
    ids=["missing", "unknown", "dtype", "rank", "fixed-dim", "string", "object"],
)
def test_bad_feeds_get_typed_errors_naming_the_input(two_output_model, feeds, message):
    sess = ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"])
    with pytest.raises(InvalidArgumentError, match=message):
        sess.run(None, feeds)


def test_other_bad_calls(two_output_model):
    sess = ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"])
    with pytest.raises(InvalidArgumentError, match=r"unknown output 'nope'; the model's outputs are"):
        sess.run(["nope"], _feeds())
    with pytest.raises(InvalidArgumentError, match="input_feed must be a dict"):
        sess.run(None, [1, 2])
    with pytest.raises(InvalidArgumentError, match="provider_options has 2 entries but providers has 1"):
        ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"], provider_options=[{}, {}])
    with pytest.raises(InvalidArgumentError, match="has no option .bogus.; it takes use_arena"):
        ort.InferenceSession(two_output_model.SerializeToString(), providers=[("cpu", {"bogus": "1"})])
    with pytest.raises(InvalidArgumentError, match=r"providers\[0\] is 42"):
        ort.InferenceSession(two_output_model.SerializeToString(), providers=[42])
    sess.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        sess.run(None, _feeds())


def test_feeds_accept_tensors_and_python_lists(two_output_model):
    sess = ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"])
    feeds = {"x": ort.Tensor.from_numpy(_feeds()["x"]), "y": [[1.0, 2.0, 3.0]]}
    total = sess.run(["sum"], feeds)[0]
    np.testing.assert_array_equal(total, _feeds()["x"] + _feeds()["y"])


def test_a_failing_kernel_names_the_node_and_provider():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")]
    shape = onnx.numpy_helper.from_array(np.array([7], np.int64), "shape")
    model = make_model(nodes, [tensor_info("x", shape=None)], [tensor_info("y")], [shape])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    with pytest.raises(
        OnnxRuntimeError, match=r"node 'bad_reshape' \(Reshape\) on CPUExecutionProvider failed"
    ) as info:
        sess.run(None, {"x": np.zeros(6, np.float32)})
    assert isinstance(info.value, (KernelError, InvalidArgumentError, OnnxRuntimeError))


def test_outputs_never_alias_weights(chain_model):
    weight = onnx.numpy_helper.from_array(np.ones(3, np.float32), "w")
    model = make_model([helper.make_node("Identity", ["w"], ["y"])], [], [tensor_info("y", shape=[3])], [weight])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    (y,) = sess.run(None, {})
    try:
        y[0] = 5.0
    except ValueError:
        pass  # a read-only view is also safe
    assert sess.run(None, {})[0].tolist() == [1.0, 1.0, 1.0]


def test_default_providers_are_the_available_ones_selected_by_default(chain_model):
    """The sample device provider (installed for these tests) opts out with its selected_by_default hook: a plain
    session does not run on it, naming it still does."""
    from onnx_runtime.discovery import default_providers

    sess = ort.InferenceSession(chain_model.SerializeToString())
    available = ort.get_available_providers()
    assert sess.get_providers() == default_providers() == [n for n in available if n != "SampleDeviceExecutionProvider"]
    x = np.ones((2, 6), np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], chain_reference(x), rtol=1e-5)
    if "SampleDeviceExecutionProvider" in available:
        named = ort.InferenceSession(chain_model.SerializeToString(), providers=["sample", "cpu"])
        assert named.get_providers() == ["SampleDeviceExecutionProvider", "CPUExecutionProvider"]
        assert named.get_provider_options() == {"SampleDeviceExecutionProvider": {}, "CPUExecutionProvider": {}}


def test_profiling_totals_per_operator_and_the_written_file(two_output_model, tmp_path):
    import json

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "prof")
    sess = ort.InferenceSession(two_output_model.SerializeToString(), options, providers=["cpu"])
    for _ in range(3):
        sess.run(None, _feeds())
    summary = sess.profile_summary()
    assert sess.profiled_runs == 3
    assert {op: calls for op, (_, calls) in summary.items()} == {"Add": 3, "Mul": 3, "Shape": 3}
    assert all(seconds > 0 for seconds, _ in summary.values())
    with open(sess.end_profiling()) as handle:
        written = json.load(handle)
    # onnxruntime's Chrome-trace list: complete events, Session ones for creation and each run, Node ones per node
    assert all({"cat", "pid", "tid", "dur", "ts", "ph", "name", "args"} <= set(e) and e["ph"] == "X" for e in written)
    session = [e["name"] for e in written if e["cat"] == "Session"]
    assert session[:2] == ["model_loading_array", "session_initialization"] and session.count("model_run") == 3
    nodes = [e for e in written if e["cat"] == "Node"]
    assert sorted(e["args"]["op_name"] for e in nodes) == ["Add"] * 3 + ["Mul"] * 3 + ["Shape"] * 3
    mul = next(e for e in nodes if e["args"]["op_name"] == "Mul")
    assert mul["name"].endswith("_kernel_time") and mul["args"]["provider"] == "CPUExecutionProvider"
    assert mul["args"]["input_type_shape"][0] == {"float": [2, 3]}
    assert [e["ts"] for e in written] == sorted(e["ts"] for e in written)
    assert sess.profiled_runs == 0  # ending the profile starts a new one
    plain = ort.InferenceSession(two_output_model.SerializeToString(), providers=["cpu"])
    assert plain.end_profiling() == ""  # as onnxruntime, with profiling off
    with pytest.raises(InvalidArgumentError, match="profiling is off"):
        plain.profile_summary()


# -- the CPU memory arena (SessionOptions.enable_cpu_mem_arena) -----------------------------------


def _arena_of(model, **settings):
    options = ort.SessionOptions()
    for key, value in settings.items():
        setattr(options, key, value)
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    return sess.provider_handle("cpu").provider.memory_arena


@pytest.fixture
def fresh_arena(monkeypatch):
    """The arena module as if no session had applied it yet (mallopt itself is faked per test)."""
    from onnx_runtime_ep_cpu import arena

    monkeypatch.setattr(arena, "_status", None)
    return arena


def test_the_arena_option_reaches_the_cpu_provider(chain_model):
    import platform

    status = _arena_of(chain_model)
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert status.applied and "MiB" in status.reason
    else:
        assert not status.applied and "not glibc" in status.reason
    off = _arena_of(chain_model, enable_cpu_mem_arena=False)
    assert not off.applied and "enable_cpu_mem_arena is off" in off.reason


def test_the_arena_raises_both_malloc_thresholds_once(fresh_arena):
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    status = fresh_arena.apply_arena_settings({}, load=lambda: (mallopt, ""))  # on by default, as onnxruntime
    assert status.applied
    assert calls == [(-3, fresh_arena.MMAP_THRESHOLD), (-1, fresh_arena.TRIM_THRESHOLD)]
    assert fresh_arena.apply_arena_settings({"session.enable_cpu_mem_arena": "1"}, load=lambda: (mallopt, "")) \
        is status
    assert len(calls) == 2  # process-wide: applied by the first session only
    off = fresh_arena.apply_arena_settings({"session.enable_cpu_mem_arena": "0"}, load=lambda: (mallopt, ""))
    assert not off.applied and "earlier session's arena stays" in off.reason


def test_the_arena_is_declined_with_a_reason(fresh_arena):
    status = fresh_arena.apply_arena_settings({}, load=lambda: (None, "the C library is not glibc (Darwin, unknown)"))
    assert not status.applied and "not glibc" in status.reason
    refused = fresh_arena.apply_arena_settings({}, load=lambda: (lambda param, value: 0, ""))
    assert not refused.applied and "refused" in refused.reason
    assert fresh_arena._status is None  # nothing was applied, so a later session tries again


def test_session_creation_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    """Creation pauses the cyclic collector; success, failure and an already-disabled collector all end
    with the collector in the state the caller had."""
    import gc

    from onnx_runtime.errors import ModelLoadError

    model = tmp_path / "m.onnx"
    onnx.save(make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=[2])],
                         [tensor_info("y", shape=[2])]), model)
    assert gc.isenabled()
    ort.InferenceSession(str(model), providers=["cpu"])
    assert gc.isenabled()
    with pytest.raises(ModelLoadError):
        ort.InferenceSession(str(tmp_path / "missing.onnx"), providers=["cpu"])
    assert gc.isenabled()
    gc.disable()
    try:
        ort.InferenceSession(str(model), providers=["cpu"])
        assert not gc.isenabled()
    finally:
        gc.enable()
