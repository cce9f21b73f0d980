"""The lookups a decode loop makes per step: the specializer serves a signature a template matched before from a
dict (a later generation passes the same lengths again) instead of testing the templates; an Attention kernel's
length-free key is the same for the decode form (Q, K, V, mask) as the general rule's; the shape-only cache keeps
only arrays, frozen, within its bounds. Results stay those of a float64 reference."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import decode_concat_model
from onnx_runtime.session import shape_program, specialize
from onnx_runtime.session.steps import ShapeValues, Steps
from onnx_runtime_ep_cpu.ops import transformer


def _step(sess, past: int, rng) -> None:
    feeds = {"x": rng.standard_normal((1, 1, 4)).astype(np.float32),
             "past": rng.standard_normal((1, past, 4)).astype(np.float32)}
    y, present = sess.run(None, feeds)
    want = np.concatenate((feeds["past"], feeds["x"]), 1).astype(np.float64)
    np.testing.assert_array_equal(present, want)
    np.testing.assert_allclose(y, feeds["x"] + want.sum(1, keepdims=True), rtol=1e-6, atol=1e-6)


@pytest.fixture
def template_tests(monkeypatch) -> list:
    """The signatures the specializer's templates are tested on."""
    tested: list = []
    original = shape_program.Template.matches

    def counting(self, signature):
        tested.append(signature)
        return original(self, signature)

    monkeypatch.setattr(shape_program.Template, "matches", counting)
    return tested


def test_a_later_generation_finds_its_signatures_without_testing_the_templates(template_tests):
    sess = ort.InferenceSession(decode_concat_model(), providers=["cpu"])
    rng = np.random.default_rng(0)
    for past in range(3, 12):  # a first generation: a template serves from the second length on
        _step(sess, past, rng)
    assert template_tests, "the first generation's new lengths are tested against the template"
    template_tests.clear()
    for past in range(3, 12):  # the next generation through the same lengths
        _step(sess, past, rng)
    assert template_tests == []


def test_the_matched_signatures_are_bounded(template_tests, monkeypatch):
    monkeypatch.setattr(specialize, "MATCHED", 3)
    sess = ort.InferenceSession(decode_concat_model(), providers=["cpu"])
    rng = np.random.default_rng(1)
    for _ in range(2):
        for past in range(3, 12):
            _step(sess, past, rng)
    assert 0 < len(sess._specializer._matched) <= 3  # noqa: SLF001 (the bound itself)
    assert template_tests  # started over: lengths dropped from it are tested again


@pytest.mark.parametrize("shapes", [
    ((1, 4, 1, 16), (1, 4, 26, 16), (1, 4, 26, 16), (1, 1, 1, 26)),  # a decode step's Q, K, V and mask
    ((1, 4, 1, 16), (1, 2, 9, 16), (1, 2, 9, 16), None),  # no mask
    ((1, 4, 1, 16), None, None, (1, 1, 1, 9)),
    ((1, 4, 3, 16), (1, 4, 5, 16), (1, 4, 5, 16)),  # no mask input
    ((1, 4, 1, 16), (1, 4, 5, 16), (1, 4, 5, 16), (1, 1, 1, 9), (1, 4, 4, 16), (1, 4, 4, 16)),  # with pasts
    ((1, 4, 1, 16), (1, 4, 1, 16), (1, 4, 1, 16), None, (1, 4, 4, 16), (1, 4, 4, 16)),  # pasts, no mask
    ((1, 4, 1, 16), (1, 4, 5, 16), (1, 4, 5, 16), (1, 1, 1, 9), (1, 4, 4, 16), (1, 4, 4, 16), (3,)),
])
def test_the_length_free_key_drops_the_keys_length_and_nothing_else(shapes):
    key = transformer._length_free_key  # noqa: SLF001
    longer = tuple(None if s is None else s[:-2] + (s[-2] + 7,) + s[-1:] if i in (1, 2, 4, 5)
                   else s[:-1] + (s[-1] + 7,) if i == 3 else s for i, s in enumerate(shapes))
    assert key(longer) == key(shapes)
    # Any other axis changed, or a shape of another rank (its length axis kept), gives another key.
    for index, shape in enumerate(shapes):
        length_axis = len(shape) - (1 if index == 3 else 2) if shape is not None and 0 < index < 6 else None
        for axis in range(len(shape or ())):
            if axis != length_axis:
                changed = shape[:axis] + (shape[axis] + 1,) + shape[axis + 1:]
                assert key(shapes[:index] + (changed,) + shapes[index + 1:]) != key(shapes), (index, axis)
        if shape is not None and length_axis is not None and length_axis > 0:
            fewer = shape[1:]  # (the same length and last axes, one leading axis less)
            assert key(shapes[:index] + (fewer,) + shapes[index + 1:]) != key(shapes), index


def _values() -> ShapeValues:
    return ShapeValues([], [], (), ())


def test_the_shape_only_cache_keeps_arrays_frozen():
    values = _values()
    kept = (np.arange(4), np.ones((2, 3), bool))
    values._keep(((1, 4),), kept)  # noqa: SLF001
    assert values.values[((1, 4),)] is kept and not any(v.flags.writeable for v in kept)
    assert values.held == sum(v.nbytes for v in kept)


def test_the_shape_only_cache_leaves_out_what_is_not_an_array_or_too_large(monkeypatch):
    values = _values()
    values._keep(((1,),), (np.arange(3), [1, 2]))  # noqa: SLF001 (a list: not kept)
    values._keep(((2,),), (np.arange(3), None))  # noqa: SLF001
    monkeypatch.setattr(ShapeValues, "BYTES", 16)
    big = np.arange(8)
    values._keep(((3,),), (big,))  # noqa: SLF001 (over the bytes an entry may hold)
    assert values.values == {} and values.held == 0 and big.flags.writeable
    assert isinstance(values.body, Steps)
