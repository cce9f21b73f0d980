"""shape_program.Template's straight-line test of a decode step's feed shapes (made once per template) against
the general test over the flattened shapes: the same symbol values or None for random templates and shapes
(other ranks, other feed counts, a symbol's dimensions that disagree), and the general test where a dimension is
of another kind."""

from __future__ import annotations

import random

import pytest
from onnx_runtime.session.shape_program import Template


def _general(template: Template, signature: tuple):
    test = template._test  # noqa: SLF001 (the two paths of one method compared)
    template._test = None  # noqa: SLF001
    try:
        return template._values(signature)  # noqa: SLF001
    finally:
        template._test = test  # noqa: SLF001


def test_a_decode_steps_shapes_give_the_symbols_values():
    past = ((1, 1), (1, 17), (1, 1), (1, 4, 16, 16), (1, 4, 16, 16))
    step = ((1, 1), (1, 18), (1, 1), (1, 4, 17, 16), (1, 4, 17, 16))
    template = Template.between(past, step)
    assert template.point(((1, 1), (1, 40), (1, 1), (1, 4, 39, 16), (1, 4, 39, 16))).tolist() == [1, 40]
    assert not template.matches(((1, 1), (1, 40), (1, 1), (1, 4, 38, 16), (1, 4, 39, 16)))  # the symbol disagrees
    assert not template.matches(((1, 1), (1, 40), (1, 1), (1, 4, 39, 16)))  # a feed fewer
    assert not template.matches(((1, 1), (1, 40), (1, 1), (1, 4, 39), (1, 4, 39, 16)))  # another rank
    assert not template.matches(((1, 2), (1, 40), (1, 1), (1, 4, 39, 16), (1, 4, 39, 16)))  # a fixed dimension
    assert not template.matches(((1, 1), (1, 40), (1, 1), (1, 4, 39, 16), None))  # a feed without a shape


def test_the_straight_line_test_agrees_with_the_general_one():
    rng = random.Random(7)
    compared = 0
    for _ in range(2000):
        reference = tuple(tuple(rng.choice([1, 2, 3, 5]) for _ in range(rng.randint(1, 4)))
                          for _ in range(rng.randint(1, 4)))
        signature = tuple(tuple(d + rng.choice([0, 0, 1, 2, -1]) if d > 1 else d for d in shape)
                          for shape in reference)
        template = Template.between(reference, signature)
        if template is None:
            continue
        for probe in range(6):
            candidate = tuple(tuple(max(0, d + rng.choice([0, 0, 1, 3, -1])) for d in shape)
                              for shape in (signature if probe else reference))
            if rng.random() < 0.1:
                candidate = candidate[:-1]
            elif rng.random() < 0.1:
                candidate = candidate[:-1] + (candidate[-1] + (1,),)
            assert template._values(candidate) == _general(template, candidate)  # noqa: SLF001
            compared += 1
    assert compared > 5000


@pytest.mark.parametrize("odd", [True, ("s", 0)])
def test_a_dimension_of_another_kind_keeps_the_general_test(odd):
    template = Template(((1, odd), (1, (0, 0))), 1)
    assert template._test is None  # noqa: SLF001
    assert template.point(((1, odd), (1, 9))).tolist() == [1, 9]
