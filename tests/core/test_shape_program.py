"""A decode loop's shape-only values evaluated once symbolically per class of feed shapes and instantiated per
step (session/shape_program.py): every step of a first generation, where the per-shapes cache cannot help, must
give bit for bit what running the steps gives, including past the base arrays' margin, where a guard fails and
the program is built again, and for graphs the evaluation does not cover."""

from __future__ import annotations

import threading

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session import shape_program, shape_symbols
from onnx_runtime.session.steps import ShapeValues

HEADS, DIM, BUCKETS = 2, 4, 6


def _decoder() -> bytes:
    """One decode step's shape work as the exporters write it: present = Concat(past, new); the query positions
    Range(total - seq, total) and key positions Range(0, total), total read off Shape(present); a causal
    LessOrEqual mask turned into a bias by Where; a T5-style relative-position bucket (Sub, Neg, Min with a
    ConstantOfShape, Cast, Log, Div, Mul, Cast, Add, Where) looked up in a table (Gather, Transpose); the
    attention mask's length Expand-ed into GatherND-style indices (Concat of Unsqueeze-d windows)."""
    c = {
        "zero": np.array(0, np.int64), "one": np.array(1, np.int64), "two": np.array(2, np.int64),
        "ax0": np.array([0], np.int64), "ax1": np.array([1], np.int64), "axm1": np.array([-1], np.int64),
        "ones": np.ones((1, HEADS, 1, DIM), np.float32), "neg": np.array(-1e4, np.float32),
        "nil": np.array(0.0, np.float32), "exact": np.array(3, np.int64), "scale": np.array(1.5, np.float32),
        "top": np.array(BUCKETS - 1, np.int64), "table": np.linspace(-1, 1, BUCKETS * HEADS, dtype=np.float32)
        .reshape(BUCKETS, HEADS), "batch0": np.zeros((1,), np.int64), "unit_f": np.array(1.0, np.float32),
        "tiny": np.array(1e-3, np.float32), "embedding": np.linspace(-2, 2, 9 * DIM, dtype=np.float32).reshape(9, DIM),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["embedding", "ids"], ["embedded"], axis=0),  # [1, T, D]
        n("Mul", ["embedded", "ones"], ["new"]),  # [1, H, T, D]
        n("Concat", ["past", "new"], ["present"], axis=2),
        n("Shape", ["ids"], ["ids_shape"]),
        n("Gather", ["ids_shape", "one"], ["seq_len"], axis=0),
        n("Shape", ["present"], ["present_shape"]),
        n("Gather", ["present_shape", "two"], ["total"], axis=0),
        n("Sub", ["total", "seq_len"], ["past_len"]),
        n("Range", ["past_len", "total", "one"], ["q_pos"]),
        n("Range", ["zero", "total", "one"], ["k_pos"]),
        n("Unsqueeze", ["k_pos", "ax0"], ["k_row"]),
        n("Unsqueeze", ["q_pos", "ax1"], ["q_col"]),
        n("LessOrEqual", ["k_row", "q_col"], ["causal"]),
        n("Where", ["causal", "nil", "neg"], ["causal_bias_0"]),  # [T, L]
        # An operator the evaluation leaves to its kernel (run per call, after the values it reads).
        n("CumSum", ["k_pos", "zero"], ["k_cum"]),
        n("Unsqueeze", ["k_cum", "ax0"], ["k_cum_row"]),
        n("Cast", ["k_cum_row"], ["k_cum_f"], to=TensorProto.FLOAT),
        n("Mul", ["k_cum_f", "tiny"], ["k_cum_small"]),
        n("Add", ["causal_bias_0", "k_cum_small"], ["causal_bias"]),
        # relative-position buckets
        n("Sub", ["k_row", "q_col"], ["rel"]),
        n("Neg", ["rel"], ["back"]),
        n("Shape", ["back"], ["back_shape"]),
        n("ConstantOfShape", ["back_shape"], ["zeros"], value=helper.make_tensor("v", TensorProto.INT64, [1], [0])),
        n("Max", ["back", "zeros"], ["dist"]),
        n("Less", ["dist", "exact"], ["near"]),
        n("Cast", ["dist"], ["dist_f"], to=TensorProto.FLOAT),
        n("Add", ["dist_f", "unit_f"], ["dist_1"]),
        n("Log", ["dist_1"], ["log"]),
        n("Mul", ["log", "scale"], ["far_f"]),
        n("Cast", ["far_f"], ["far_i"], to=TensorProto.INT64),
        n("Add", ["far_i", "exact"], ["far"]),
        n("Min", ["far", "top"], ["far_top"]),
        n("Where", ["near", "dist", "far_top"], ["bucket"]),
        n("Gather", ["table", "bucket"], ["rel_bias"], axis=0),  # [T, L, H]
        n("Transpose", ["rel_bias"], ["rel_bias_t"], perm=[2, 0, 1]),  # [H, T, L]
        n("Add", ["rel_bias_t", "causal_bias"], ["bias"]),
        # the attention mask's positions as GatherND-style (batch, position) pairs
        n("Shape", ["mask"], ["mask_shape"]),
        n("Gather", ["mask_shape", "one"], ["mask_len"], axis=0),
        n("Range", ["zero", "mask_len", "one"], ["m_pos"]),
        n("Unsqueeze", ["mask_len", "ax0"], ["mask_len_v"]),
        n("Expand", ["batch0", "mask_len_v"], ["batch_idx"]),
        n("Unsqueeze", ["batch_idx", "axm1"], ["batch_col"]),
        n("Unsqueeze", ["m_pos", "axm1"], ["pos_col"]),
        n("Concat", ["batch_col", "pos_col"], ["pairs"], axis=-1),
        n("GatherND", ["mask", "pairs"], ["mask_values"]),
        n("Cast", ["mask_values"], ["mask_f"], to=TensorProto.FLOAT),
        # scores = new . present^T + bias, weighted by the mask
        n("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["new", "present_t"], ["raw"]),
        n("Add", ["raw", "bias"], ["biased"]),
        n("Mul", ["biased", "mask_f"], ["scores"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("ids", TensorProto.INT64, [1, "seq"]),
         tensor_info("past", TensorProto.FLOAT, [1, HEADS, "past", DIM]),
         tensor_info("mask", TensorProto.INT64, [1, "total"])],
        [tensor_info("scores", TensorProto.FLOAT, None), tensor_info("present", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in c.items()])
    return model.SerializeToString()


def _loop(sess, steps: int, start: int = 3, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """A prefill of ``start`` tokens, then one token per step with the present fed back as the past."""
    rng = np.random.default_rng(seed)
    past = np.zeros((1, HEADS, 0, DIM), np.float32)
    ids = rng.integers(1, 9, (1, start))
    results = []
    for _ in range(steps + 1):
        total = past.shape[2] + ids.shape[1]
        mask = rng.integers(0, 2, (1, total))
        scores, present = sess.run(None, {"ids": ids, "past": past, "mask": mask})
        results.append((scores, present))
        past, ids = present, rng.integers(1, 9, (1, 1))
    return results


def _ours(specialize: str = "1") -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", specialize)
    return ort.InferenceSession(_decoder(), options, providers=["cpu"])


@pytest.fixture
def instantiations(monkeypatch):
    """Counts the programs' instantiations that set values (a guard that failed does not count)."""
    counts = {"set": 0}
    original = shape_program.Program.instantiate

    def counting(self, env, point):
        done = original(self, env, point)
        counts["set"] += done
        return done

    monkeypatch.setattr(shape_program.Program, "instantiate", counting)
    return counts


@pytest.mark.parametrize("specialize", ["0", "1"])
def test_first_generation_is_instantiated_and_equals_running_the_steps(specialize, instantiations, monkeypatch):
    steps = 24
    ours = _loop(_ours(specialize), steps)
    assert instantiations["set"] >= steps - 4  # every new past length after the class's first two
    monkeypatch.setattr(ShapeValues, "PROGRAMS", 0)  # the steps run at every new length
    reference = _loop(_ours(specialize), steps)
    oracle = _loop(onnxruntime.InferenceSession(_decoder(), providers=["CPUExecutionProvider"]), steps)
    for (scores, present), (want, want_present), (theirs, _) in zip(ours, reference, oracle):
        np.testing.assert_array_equal(scores, want)
        np.testing.assert_array_equal(present, want_present)
        np.testing.assert_allclose(scores, theirs, rtol=1e-6, atol=1e-4)


def test_past_the_margin_the_program_is_built_again(instantiations, monkeypatch):
    monkeypatch.setattr(shape_symbols, "MARGIN", 3)
    built = {"count": 0}
    original = shape_program.build

    def counting(*args, **kwargs):
        built["count"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(shape_program, "build", counting)
    ours = _loop(_ours(), 20)
    assert built["count"] >= 3 and instantiations["set"] >= 12
    monkeypatch.setattr(ShapeValues, "PROGRAMS", 0)
    for (scores, present), (want, want_present) in zip(ours, _loop(_ours(), 20)):
        np.testing.assert_array_equal(scores, want)
        np.testing.assert_array_equal(present, want_present)


def test_an_empty_range_falls_back_to_the_steps():
    """Range(past_len, total) with a prompt of 0 tokens is empty: the guard on its extent holds at 0, and the
    results are the graph's."""
    sess = _ours()
    rng = np.random.default_rng(3)
    for past_len in (2, 3, 4, 5):
        past = rng.standard_normal((1, HEADS, past_len, DIM)).astype(np.float32)
        for ids in (rng.integers(1, 9, (1, 1)), np.zeros((1, 0), np.int64)):
            mask = np.ones((1, past_len + ids.shape[1]), np.int64)
            scores, present = sess.run(None, {"ids": ids, "past": past, "mask": mask})
            assert scores.shape == (1, HEADS, ids.shape[1], past_len + ids.shape[1])
            np.testing.assert_array_equal(present[:, :, :past_len], past)


def test_templates_share_a_symbol_between_lengths_that_grow_alike():
    template = shape_program.Template.between(((1, 1), (1, 2, 5, 4), (1, 6)), ((1, 1), (1, 2, 6, 4), (1, 7)))
    assert template.symbols == 1
    np.testing.assert_array_equal(template.point(((1, 1), (1, 2, 40, 4), (1, 41))), [1, 40])
    assert template.point(((1, 1), (1, 2, 40, 4), (1, 40))) is None  # the mask no longer one longer
    assert template.point(((1, 2), (1, 2, 40, 4), (1, 41))) is None  # a fixed dimension changed
    assert template.point(((1, 1), (1, 2, 40), (1, 41))) is None  # another rank
    assert shape_program.Template.between(((1, 1),), ((1, 1, 1),)) is None
    unrelated = shape_program.Template.between(((1, 5), (1, 9)), ((1, 6), (1, 7)))
    assert unrelated.symbols == 2
    np.testing.assert_array_equal(unrelated.point(((1, 8), (1, 3))), [1, 8, 3])


def test_a_program_that_differs_from_the_steps_where_it_was_built_is_dropped(monkeypatch):
    """A new program is checked against the steps at the shapes it was built for (a declared shape that was stale
    would make it differ there): one that differs is dropped for its class and the steps keep running."""
    original = shape_program.build

    def wrong_by_one(*args, **kwargs):
        built = original(*args, **kwargs)
        if built is not None:
            program, _ = built
            for value in program.symbolic.values():
                if isinstance(value, shape_symbols.Window) and value.base.dtype.kind == "f":
                    value.base = value.base + 1
        return built

    monkeypatch.setattr(shape_program, "build", wrong_by_one)
    ours = _loop(_ours(), 12)
    monkeypatch.setattr(ShapeValues, "PROGRAMS", 0)
    for (scores, present), (want, want_present) in zip(ours, _loop(_ours(), 12)):
        np.testing.assert_array_equal(scores, want)
        np.testing.assert_array_equal(present, want_present)


def test_loops_in_threads_over_one_session_give_the_steps_values():
    """Runs of one plan may overlap (several threads, one session): programs built, checked, rebuilt past the
    margin and dropped by one run while another reads them still give every run the graph's values."""
    sess = _ours()
    starts = (3, 5, 8, 13)
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def loop(start: int) -> None:
        try:
            results[start] = _loop(sess, 30, start=start, seed=start)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(start,)) for start in starts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for start in starts:
        for (scores, present), (want, want_present) in zip(results[start], _loop(_ours(), 30, start=start,
                                                                                   seed=start)):
            np.testing.assert_array_equal(scores, want)
            np.testing.assert_array_equal(present, want_present)


def test_the_straight_code_sets_what_the_loop_sets(monkeypatch):
    """Each program's instantiation runs as straight-line code; it sets the loop's values (fresh arrays each call,
    the same dtypes and contents) and fails the same guards."""
    made = []
    init = shape_program.Program.__init__

    def recording(self, *args):
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(shape_program.Program, "__init__", recording)
    _loop(_ours(), 12)
    assert made and all(program._code is not None for program in made)  # noqa: SLF001
    for program in made:
        size = max(program.needed) + 1
        for length in (2, 5, 9, 40, 700):
            point = np.array([1] + [length] * (program.forms.shape[1] - 1), np.int64)
            straight, looped = [None] * size, [None] * size
            done = program.instantiate(straight, point)
            code, program._code = program._code, None  # noqa: SLF001
            try:
                assert program.instantiate(looped, point) == done
            finally:
                program._code = code  # noqa: SLF001
            again = [None] * size
            program.instantiate(again, point)
            for slot in program.needed if done else ():
                a, b = straight[slot], looped[slot]
                assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
                assert again[slot] is not a or not isinstance(a, np.ndarray) or not a.flags.writeable
