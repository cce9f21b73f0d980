"""A shape program's values (a first generation or a chunked prefill instantiates them at every new length)
are what their definitions give: windows cut on their sliced axes and broadcast on base axes of length 1, ranges
with one moving axis, affine forms; as fresh writable C-ordered arrays."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.session.shape_program import Program, _materialize
from onnx_runtime.session.shape_symbols import Affine, Linear, Window


def _form(constant: int, per_symbol: int = 0) -> np.ndarray:
    return np.array([constant, per_symbol], np.int64)


CASES = [
    # base, lows, extents (affine in one symbol s: constant + per_symbol * s)
    (np.arange(530).reshape(1, 1, 1, 530) % 3 == 0, [_form(0)] * 3 + [_form(256, -1)],
     [_form(1)] * 3 + [_form(1, 1)]),
    (np.arange(1060, dtype=np.int64).reshape(1, 1, 1, 530, 2), [_form(0)] * 3 + [_form(200, -1), _form(0)],
     [_form(1)] * 3 + [_form(3, 1), _form(2)]),
    (np.arange(40, dtype=np.float32).reshape(1, 40), [_form(0), _form(5)], [_form(4), _form(0, 1)]),  # broadcast
    (np.arange(120, dtype=np.int32).reshape(3, 40), [_form(1), _form(0, 1)], [_form(2), _form(2)]),
]


@pytest.mark.parametrize(("base", "lows", "extents"), CASES)
@pytest.mark.parametrize("symbol", [0, 1, 7, 30])
def test_window_matches_the_general_materialization(base, lows, extents, symbol):
    window = Window(base, tuple(lows), tuple(extents))
    program = Program({3: window}, (3,), [], 1)
    point = np.array([1, symbol], np.int64)
    env: list = [None] * 4
    assert program.instantiate(env, point)
    numbers = (program.forms @ point).tolist()
    expected = _materialize(window, numbers, program.recipes[0][2])
    assert env[3].shape == expected.shape == tuple(numbers[base.ndim:2 * base.ndim])
    assert env[3].dtype == base.dtype
    np.testing.assert_array_equal(env[3], expected)
    assert env[3].flags.writeable and env[3].flags.c_contiguous and not np.shares_memory(env[3], base)


@pytest.mark.parametrize("alpha", [(0, 1), (0, -1), (1, 0, 0), (0, 0, 0, 1), (1, 1)])
@pytest.mark.parametrize("symbol", [0, 1, 9])
def test_linear_values_match_their_definition(alpha, symbol):
    # beta + sum over axes of alpha[axis] * index[axis], extents (2 + s) on moving axes and 3 elsewhere
    extents = tuple(_form(2, 1) if a else _form(3) for a in alpha)
    value = Linear(alpha, _form(5, 2), extents, np.dtype(np.int32))
    program = Program({1: value}, (1,), [], 1)
    env: list = [None] * 2
    assert program.instantiate(env, np.array([1, symbol], np.int64))
    sizes = [2 + symbol if a else 3 for a in alpha]
    grid = np.indices(sizes, dtype=np.int64) if sizes else np.zeros((0,), np.int64)
    expected = 5 + 2 * symbol + sum(a * grid[axis] for axis, a in enumerate(alpha))
    assert env[1].dtype == np.int32 and env[1].flags.c_contiguous and env[1].flags.writeable
    np.testing.assert_array_equal(env[1], expected)


@pytest.mark.parametrize("shape", [(), (3,), (2, 4), (0, 3)])
def test_affine_values_match_their_definition(shape):
    rng = np.random.default_rng(len(shape))
    coef = rng.integers(-50, 50, size=(3, *shape)).astype(np.int64)
    point = np.array([1, 7, -2], np.int64)
    value = Affine(coef, np.int32).at(point)
    expected = coef[0] + 7 * coef[1] - 2 * coef[2]
    assert value.shape == shape and value.dtype == np.int32
    np.testing.assert_array_equal(value, expected)


@pytest.mark.parametrize("alpha", [(0, 1), (0, -1), (0, 0, 0, 3), (1,)])
@pytest.mark.parametrize("symbol", [0, 1, 9])
def test_an_int64_range_without_broadcast_is_one_arange(alpha, symbol, monkeypatch):
    """A position Range (int64, one moving axis, every other extent 1): its definition, made without broadcasting
    or casting (a first generation makes one at every new length)."""
    extents = tuple(_form(2, 1) if a else _form(1) for a in alpha)
    value = Linear(alpha, _form(5, 2), extents, np.dtype(np.int64))
    program = Program({1: value}, (1,), [], 1)
    env: list = [None] * 2

    def refused(*_args, **_kwargs):
        raise AssertionError("broadcast a value that has nothing to broadcast")

    monkeypatch.setattr(np, "broadcast_to", refused)
    assert program.instantiate(env, np.array([1, symbol], np.int64))
    sizes = [2 + symbol if a else 1 for a in alpha]
    grid = np.indices(sizes, dtype=np.int64)
    expected = 5 + 2 * symbol + sum(a * grid[axis] for axis, a in enumerate(alpha))
    assert env[1].dtype == np.int64 and env[1].shape == tuple(sizes)
    assert env[1].flags.c_contiguous and env[1].flags.writeable
    np.testing.assert_array_equal(env[1], expected)


@pytest.mark.parametrize("symbols", [1, 2])
def test_the_straight_code_fails_exactly_the_points_a_guard_fails(symbols):
    """The straight-line code keeps only the distinct guards (with one symbol, its lowest and highest value): it
    fails the same points as every guard row tested one by one, for a list or an array point."""
    rng = np.random.default_rng(symbols)
    zero, one, three = (np.array([n] + [0] * symbols, np.int64) for n in (0, 1, 3))
    window = Window(np.arange(40, dtype=np.float32).reshape(1, 40), (zero, zero), (one, three))
    grid = np.stack(np.meshgrid(*[np.arange(-10, 22)] * symbols, indexing="ij"), -1).reshape(-1, symbols)
    for _ in range(40):
        guards = [rng.integers(-20, 21, 1 + symbols) for _ in range(rng.integers(0, 7))]
        guards += guards[:1]  # (a repeated row)
        guards += [np.array([rng.integers(-1, 3)] + [0] * symbols)] * int(rng.integers(0, 2))  # (no symbol)
        program = Program({1: window}, (1,), guards, symbols)
        assert program._code is not None  # noqa: SLF001
        for values in grid:
            point = np.array([1, *values], np.int64)
            want = all(int(g @ point) >= 0 for g in guards)
            env: list = [None] * 2
            assert program.instantiate(env, point.tolist()) is want
            assert program.instantiate([None] * 2, point) is want
            if want:
                np.testing.assert_array_equal(env[1], np.arange(3, dtype=np.float32).reshape(1, 3))


def test_a_window_whose_unit_axes_keep_extent_one_is_cut_without_broadcasting():
    """A mask bias's window (base axes of length 1 whose extents are always 1): cut and copied, its shape never
    compared for a broadcast."""
    base, lows, extents = CASES[0]
    program = Program({3: Window(base, tuple(lows), tuple(extents))}, (3,), [], 1)
    assert "broadcast_to" not in program._code.__code__.co_names  # noqa: SLF001
    for symbol in (0, 1, 7, 30):
        env: list = [None] * 4
        assert program.instantiate(env, [1, symbol])
        np.testing.assert_array_equal(env[3], base[:, :, :, 256 - symbol:257])
        assert env[3].flags.writeable and env[3].flags.c_contiguous and not np.shares_memory(env[3], base)
