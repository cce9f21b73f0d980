"""The persistent plan cache (plan_cache.py, session/cached_plans.py): a second session of the same model, options
and providers reads the optimized graph and its specializations instead of making them, with the same outputs;
every part of the key invalidates; corrupt and foreign files are ignored with a warning; the folder is bounded;
writers replace files atomically; the cache turns off."""

from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime import plan_cache
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session import cached_plans, inference_session


def _model(scale: float = 1.0) -> bytes:
    """y = Reshape(Relu(x @ W + b) * x2, [batch, -1]) with the batch taken from Shape(x): a symbolic batch, a
    shape subgraph the specialization folds, weights the plan refers to and a folded constant."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 6)) * scale).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Mul", ["r", "r"], ["q"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["q", "target"], ["y"]),
    ]
    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("one", 1),
                                                                                ("minus_one", -1))]
    model = make_model(nodes, [tensor_info("x", shape=["batch", 3, 8])], [tensor_info("y", shape=None)],
                       [w, b, *consts])
    return model.SerializeToString()


def _session(model, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    options = options or ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


FEED = {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)}


def _expected(model_bytes: bytes) -> np.ndarray:
    import onnxruntime

    return onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(None, FEED)[0]


def _refuse_optimizer(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the optimizer ran although the plan was cached")

    monkeypatch.setattr(inference_session, "optimize", refuse)


def _plans(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_a_second_session_reads_its_plans_and_matches(cache_dir, monkeypatch):
    model = _model()
    first = _session(model)
    got = first.run(None, FEED)[0]
    written = _plans(cache_dir)
    assert any(name.endswith("-graph.plan") for name in written)
    assert any("-sig-" in name for name in written)  # the specialization of the first run's shapes
    _refuse_optimizer(monkeypatch)  # neither creation nor the first run may optimize again
    second = _session(model)
    assert second.applied_passes() == first.applied_passes()
    assert (second.get_inputs(), second.get_outputs()) == (first.get_inputs(), first.get_outputs())
    assert second.get_modelmeta() == first.get_modelmeta()
    assert second.placement().as_dict() == first.placement().as_dict()
    again = second.run(None, FEED)[0]
    np.testing.assert_array_equal(again, got)
    np.testing.assert_allclose(again, _expected(model), rtol=1e-5, atol=1e-6)
    assert second.graph_for(FEED) is not second.model.graph  # served by the cached specialization


def test_a_model_file_and_its_bytes_share_nothing_stale(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    path.write_bytes(_model())
    _session(str(path)).run(None, FEED)
    path.write_bytes(_model(scale=2.0))  # same path, other weights: another key
    calls = []
    original = inference_session.optimize
    monkeypatch.setattr(inference_session, "optimize", lambda *a, **k: calls.append(1) or original(*a, **k))
    got = _session(str(path)).run(None, FEED)[0]
    assert calls, "a changed model file was served from the old file's plan"
    np.testing.assert_allclose(got, _expected(path.read_bytes()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change", ["optimization level", "config entry", "threads", "free dimension",
                                    "environment", "code", "host"])
def test_every_part_of_the_key_invalidates(cache_dir, monkeypatch, change):
    model = _model()
    _session(model).run(None, FEED)
    options = ort.SessionOptions()
    if change == "optimization level":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    elif change == "config entry":
        options.add_session_config_entry("session.some_setting", "1")
    elif change == "threads":
        options.inter_op_num_threads = 2
    elif change == "free dimension":
        options.add_free_dimension_override_by_name("batch", 2)
    elif change == "environment":
        monkeypatch.setenv("ONNX_RUNTIME_SOME_KNOB", "1")
    elif change == "code":  # an edited module of the runtime or of a provider
        monkeypatch.setattr(plan_cache, "package_fingerprint", lambda module: f"edited {module}")
    else:
        monkeypatch.setattr(plan_cache, "_host", lambda: "another CPU")
    before = set(_plans(cache_dir))
    _session(model, options).run(None, FEED)
    assert any(name.endswith("-graph.plan") for name in set(_plans(cache_dir)) - before), \
        f"a session with another {change} read the earlier plan"


def test_a_corrupt_plan_is_ignored_with_a_warning_and_rewritten(cache_dir, monkeypatch):
    model = _model()
    expected = _session(model).run(None, FEED)[0]
    graph_file = next(cache_dir.glob("*-graph.plan"))
    data = bytearray(graph_file.read_bytes())
    data[-20] ^= 0xFF  # a flipped bit in the payload
    graph_file.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        session = _session(model)
    np.testing.assert_array_equal(session.run(None, FEED)[0], expected)
    _refuse_optimizer(monkeypatch)  # the bad file was replaced by a good one, which the next session reads
    np.testing.assert_array_equal(_session(model).run(None, FEED)[0], expected)


def test_a_truncated_or_foreign_plan_is_never_used(cache_dir):
    model, other = _model(), _model(scale=3.0)
    _session(model).run(None, FEED)
    (foreign,) = cache_dir.glob("*-graph.plan")
    expected = _session(other).run(None, FEED)[0]
    (mine,) = set(cache_dir.glob("*-graph.plan")) - {foreign}
    mine.write_bytes(foreign.read_bytes())  # another model's plan under this model's name
    with pytest.warns(RuntimeWarning, match="another model"):
        got = _session(other).run(None, FEED)[0]
    np.testing.assert_array_equal(got, expected)
    mine.write_bytes(mine.read_bytes()[:40])
    with pytest.warns(RuntimeWarning, match="ignoring plan cache file"):
        np.testing.assert_array_equal(_session(other).run(None, FEED)[0], expected)


def test_the_folder_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "PRUNE_EVERY", 1)  # (a process checks at its first write and every 16th)
    cache = plan_cache.PlanCache(str(tmp_path), "k" * 64, limit_bytes=3000)
    for index in range(5):
        cache.store(f"p{index}", {}, {"graph": bytes(1000)})
        os.utime(cache.path(f"p{index}"), (index, index))  # p0 oldest
    cache.store("p5", {}, {"graph": bytes(1000)})
    left = _plans(tmp_path)
    assert sum(os.path.getsize(tmp_path / name) for name in left) <= 3000
    assert cache.path("p5").rsplit("/", 1)[1] in left and "p0" not in " ".join(left)
    assert cache.load("p5") == ({}, {"graph": bytes(1000)})


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    cache = plan_cache.PlanCache(str(tmp_path), "k" * 64, limit_bytes=1 << 30)
    bodies = [bytes([index]) * 200_000 for index in range(8)]
    threads = [threading.Thread(target=cache.store, args=("graph", {"i": i}, {"graph": body}))
               for i, body in enumerate(bodies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    meta, sections = cache.load("graph")
    assert sections["graph"] == bodies[meta["i"]]
    assert _plans(tmp_path) == [os.path.basename(cache.path("graph"))]  # no temporary file left


@pytest.mark.parametrize("how", ["environment", "config entry"])
def test_the_cache_turns_off(cache_dir, monkeypatch, how):
    options = ort.SessionOptions()
    if how == "environment":
        monkeypatch.setenv(plan_cache.ENV_ENABLE, "0")
    else:
        options.add_session_config_entry(plan_cache.ENABLE_KEY, "0")
    _session(_model(), options).run(None, FEED)
    assert _plans(cache_dir) == []


def test_an_unwritable_folder_costs_a_warning_not_the_session(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(plan_cache.ENV_ENABLE, "1")
    monkeypatch.setenv(plan_cache.ENV_DIR, str(blocker / "plans"))
    with pytest.warns(RuntimeWarning, match="could not be written"):
        got = _session(_model()).run(None, FEED)[0]
    np.testing.assert_allclose(got, _expected(_model()), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per folder and process
        _session(_model(scale=2.0)).run(None, FEED)


def test_a_bad_size_bound_is_a_typed_error(cache_dir, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_LIMIT, "lots")
    with pytest.raises(InvalidArgumentError, match="ONNX_RUNTIME_PLAN_CACHE_MB='lots' is not a size in MB"):
        _session(_model())


def test_a_model_proto_is_not_cached(cache_dir):
    _session(onnx.load_from_string(_model()))
    assert _plans(cache_dir) == []


def test_weights_are_referenced_not_copied(cache_dir):
    rng = np.random.default_rng(2)
    big = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "W")
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"])],
                       [tensor_info("x", shape=["n", 256])], [tensor_info("y", shape=["n", 256])], [big])
    data = model.SerializeToString()
    _session(data).run(None, {"x": np.ones((2, 256), np.float32)})
    assert max(p.stat().st_size for p in cache_dir.glob("*.plan")) < 256 * 256 * 4 // 4
    _session(data).run(None, {"x": np.ones((2, 256), np.float32)})  # read back with the weight from the model


def test_the_key_covers_provider_options(cache_dir):
    options = ort.SessionOptions()
    config = inference_session.session_config(options)
    handle = _session(_model()).provider_handle("CPUExecutionProvider")
    keys = {cached_plans.open_plans(options, config, _model(), [handle], provider_options, ()).key
            for provider_options in ({}, {handle.name: {"some_option": "1"}})}
    assert len(keys) == 2


def test_a_plan_whose_passes_made_large_weights_is_not_kept(cache_dir, monkeypatch):
    rng = np.random.default_rng(3)
    halves = [numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), name) for name in "PQ"]
    nodes = [helper.make_node("Add", ["P", "Q"], ["W"]), helper.make_node("MatMul", ["x", "W"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[2, 128])], [tensor_info("y", shape=[2, 128])],
                       halves).SerializeToString()
    monkeypatch.setenv(plan_cache.ENV_LIMIT, "0.1")  # a quarter: 26 KB, less than the folded 64 KB weight
    x = {"x": rng.standard_normal((2, 128)).astype(np.float32)}
    got = _session(model).run(None, x)[0]
    assert not list(cache_dir.glob("*-graph.plan"))
    monkeypatch.setenv(plan_cache.ENV_LIMIT, "1")
    _session(model).run(None, x)
    assert list(cache_dir.glob("*-graph.plan"))  # kept under a larger bound, and read back right:
    _refuse_optimizer(monkeypatch)
    np.testing.assert_allclose(_session(model).run(None, x)[0], got, rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a failed specialization would warn and run the generic plan
def test_a_cached_session_specializes_new_signatures_right(cache_dir, monkeypatch):
    import onnxruntime

    model = _model()
    _session(model).run(None, FEED)
    reference = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    cached = _session(model)
    for batch in (2, 5, 7, 2):  # the cached signature, then new ones (a template with a symbolic batch)
        feed = {"x": np.random.default_rng(batch).standard_normal((batch, 3, 8)).astype(np.float32)}
        np.testing.assert_allclose(cached.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-5, atol=1e-6)
    _refuse_optimizer(monkeypatch)  # the exact signature and the template are now cached too
    again = _session(model)
    for batch in (2, 5):
        feed = {"x": np.ones((batch, 3, 8), np.float32)}
        np.testing.assert_allclose(again.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-5, atol=1e-6)


def test_variables_that_change_no_plan_are_not_keyed(cache_dir, monkeypatch):
    options = ort.SessionOptions()
    config = inference_session.session_config(options)
    handle = _session(_model()).provider_handle("CPUExecutionProvider")

    def key():
        return cached_plans.open_plans(options, config, _model(), [handle], {}, ()).key

    before = key()
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # steady-state benchmarks set it
    monkeypatch.setenv(plan_cache.ENV_LIMIT, "512")
    assert key() == before
    monkeypatch.setenv("ONNX_RUNTIME_CPU_SOME_KNOB", "3")
    assert key() != before


def test_the_key_reads_only_the_runtimes_variables(monkeypatch):
    """The key holds the ONNX_RUNTIME_* variables' values; the other variables' values are never read (each read of
    os.environ decodes one, at every cached creation)."""
    read: list[str] = []

    class Watched(dict):
        def __getitem__(self, name):
            read.append(name)
            return super().__getitem__(name)

        def items(self):
            return [(name, self[name]) for name in self]

    class Fake:
        name, source, provider = "CPUExecutionProvider", "entry point", object()

    monkeypatch.setattr(plan_cache, "_provider_version", lambda handle: "1.0")
    environment = {"HOME": "/somewhere", "ONNX_RUNTIME_CPU_SOME_KNOB": "3", plan_cache.ENV_LIMIT: "512"}
    monkeypatch.setattr(os, "environ", Watched(environment))
    first = plan_cache.plan_key("digest", {}, [Fake()])
    assert read == ["ONNX_RUNTIME_CPU_SOME_KNOB"]
    monkeypatch.setattr(os, "environ", Watched(environment, ONNX_RUNTIME_CPU_SOME_KNOB="4"))
    assert plan_cache.plan_key("digest", {}, [Fake()]) != first


def test_the_key_covers_the_provider_set_and_versions(monkeypatch):
    class Fake:
        def __init__(self, name, source="entry point"):
            self.name, self.source, self.provider = name, source, object()

    def key(handles, versions=None):
        monkeypatch.setattr(plan_cache, "_provider_version", lambda handle: (versions or {}).get(handle.name, "1.0"))
        return plan_cache.plan_key("digest", {}, handles)

    cpu, other = Fake("CPUExecutionProvider"), Fake("OtherExecutionProvider")
    keys = [key([cpu]), key([cpu, other]), key([other, cpu]), key([cpu], {"CPUExecutionProvider": "2.0"}),
            key([Fake("CPUExecutionProvider", source="in-process")])]
    assert len(set(keys)) == len(keys)


def test_changed_external_data_is_another_key(cache_dir, tmp_path, monkeypatch):
    model = onnx.load_from_string(_model())
    path = tmp_path / "external.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="external.data", size_threshold=0)
    _session(str(path)).run(None, FEED)
    data = tmp_path / "external.data"
    os.utime(data, ns=(1, 1))  # rewritten weights (same size)
    calls = []
    original = inference_session.optimize
    monkeypatch.setattr(inference_session, "optimize", lambda *a, **k: calls.append(1) or original(*a, **k))
    _session(str(path)).run(None, FEED)
    assert calls, "a model whose external data changed was served from the old plan"


def test_a_model_file_changed_while_planning_writes_no_plan(cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    path.write_bytes(_model())
    original = inference_session.optimize

    def optimize_while_the_file_changes(*args, **kwargs):
        path.write_bytes(_model(scale=5.0))  # another export lands mid-creation
        return original(*args, **kwargs)

    monkeypatch.setattr(inference_session, "optimize", optimize_while_the_file_changes)
    _session(str(path))
    assert not list(cache_dir.glob("*-graph.plan"))
