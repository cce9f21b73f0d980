"""The channel-major convolution's requantizing tiles (compiled/qgemm_quads): AMX's tile groups (where the process has
them), VNNI's register tiles (where those run) and the portable loop each give the float64 reference's codes and
values: int32 sums of signed weight rows by unsigned patch quads plus the zero points' terms, wrapped, then
rint(total * factor + shift) + z saturated, for full and partial blocks of positions, channel ranges past a tile,
codes' bytes and dequantized float32 out, and positions past ``count`` left as they were."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import qgemm_quads

BLOCK = 64


def _case(rng, rows, depth4):
    weight = rng.integers(-128, 128, (rows, 4 * depth4)).astype(np.int8)
    patches = rng.integers(0, 256, depth4 * BLOCK * 4).astype(np.uint8)
    terms = rng.integers(-(2 ** 20), 2 ** 20, rows).astype(np.int32)
    zeros = rng.integers(-3, 4, rows).astype(np.int32)
    sums = rng.integers(0, 255 * 4 * depth4, BLOCK).astype(np.int32)
    factors = rng.uniform(1e-4, 4e-4, rows)
    shifts = rng.uniform(-20.0, 20.0, rows)
    z, s = 7.0, 0.05
    bounds = np.array([0 - z, 255 - z, z, s])
    return weight, patches, terms, zeros, sums, factors, shifts, bounds


def _reference(weight, patches, terms, zeros, sums, factors, shifts, bounds, first, end, count, dequantize):
    depth = weight.shape[1]
    k = np.arange(depth)
    patch = patches[(k // 4)[:, None] * 4 * BLOCK + 4 * np.arange(count)[None, :] + (k % 4)[:, None]]
    acc = weight[first:end].astype(np.int64) @ patch.astype(np.int64)
    total = acc + terms[first:end, None] - zeros[first:end, None].astype(np.int64) * sums[None, :count]
    total = ((total + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.float64)
    v = total * factors[first:end, None] + shifts[first:end, None]
    v = np.rint(np.clip(v, bounds[0], bounds[1]))
    return (v * bounds[3]).astype(np.float32) if dequantize else (v + bounds[2]).astype(np.uint8)


IMPLEMENTATIONS = {"portable": (qgemm_quads.portable_requantized_tiles, True, False),
                   "vnni": (qgemm_quads.vnni_requantized_tiles, qgemm_quads.AVAILABLE, False),
                   "amx": (qgemm_quads.amx_requantized_tiles, qgemm_quads.AMX, True)}


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("count", [64, 37, 5])
@pytest.mark.parametrize("span", [(0, 37), (4, 9), (32, 70)], ids=["tail", "few", "second-group"])
@pytest.mark.parametrize("dequantize", [False, True])
def test_tiles_give_the_reference(name, count, span, dequantize):
    function, runs, padded = IMPLEMENTATIONS[name]
    if not runs:
        pytest.skip(f"{name}'s instructions are not on this host")
    rng = np.random.default_rng(count + span[0])
    depth4 = 32 if padded else 19  # (AMX reads k in chunks of 64 bytes: amx_rows pads them)
    weight, patches, terms, zeros, sums, factors, shifts, bounds = _case(rng, 96 if padded else 70, depth4)
    first, end = span
    ldo = 80  # each channel's plane: a block's positions and more
    out = np.full((end - first) * ldo, 3, np.float32 if dequantize else np.uint8)
    function(weight, first, end, patches, 0, 4 * BLOCK, (count + 15) // 16, terms, zeros, sums, factors, shifts,
             bounds, out, 0, ldo, count)
    planes = out.reshape(end - first, ldo)
    want = _reference(weight, patches, terms, zeros, sums, factors, shifts, bounds, first, end, count, dequantize)
    np.testing.assert_array_equal(planes[:, :count], want)
    assert (planes[:, count:] == 3).all()  # nothing written past the positions
