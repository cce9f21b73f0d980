"""The rotate-half rotary embedding of a QDQ decoder (LLaMA-style, both torch exporters) with its activations
rounded to their grids between the operators (qdq_rotary.fuse_rounded_rotary): x * cos -> round1;
concat(-x[..., half:], x[..., :half]) with the negation rounded (round2) and the concatenation rounded (round3);
that times sin -> round4; the two products added, then rounded (round5) or not, in one pass per row.

Each step is the float32 operation its node performs, and each rounding QuantizeLinear -> DequantizeLinear's
(quantize.on_grid), so the values are the unfused nodes' bit for bit (the negation's GridTable holds on_grid of the
negated grid values, the same numbers).
"""

from __future__ import annotations

from . import jit
from .quantize import on_grid

# The layout of ``params`` (float32): per rounding (the cos product, the negation, the concatenation, the sin
# product, the sum) its scale, zero point and code range.
COS, NEG, CAT, SIN, SUM = 0, 4, 8, 12, 16
PARAMS = 20


@jit
def rounded_rotary(x, cos, sin, table_row, half, params, rounded_sum, out):
    """out[r] = round1(x[r] * cos[t]) + round4(round3(concat(round2(-x[r, half:]), x[r, :half])) * sin[t]), the
    sum rounded by round5 where ``rounded_sum``, with t = table_row[r] (the tables' broadcast over batch and
    heads) for (rows, D) float32 ``x`` and ``out`` and (table rows, D) ``cos`` and ``sin``."""
    d = x.shape[1]
    rest = d - half
    s1, z1, lo1, hi1 = params[COS], params[COS + 1], params[COS + 2], params[COS + 3]
    sn, zn, lon, hin = params[NEG], params[NEG + 1], params[NEG + 2], params[NEG + 3]
    sc, zc, loc, hic = params[CAT], params[CAT + 1], params[CAT + 2], params[CAT + 3]
    s4, z4, lo4, hi4 = params[SIN], params[SIN + 1], params[SIN + 2], params[SIN + 3]
    s5, z5, lo5, hi5 = params[SUM], params[SUM + 1], params[SUM + 2], params[SUM + 3]
    for r in range(x.shape[0]):
        t = table_row[r]
        row, c, s, o = x[r], cos[t], sin[t], out[r]
        for j in range(rest):
            turned = on_grid(on_grid(-row[half + j], sn, zn, lon, hin), sc, zc, loc, hic)
            o[j] = on_grid(row[j] * c[j], s1, z1, lo1, hi1) + on_grid(turned * s[j], s4, z4, lo4, hi4)
        for j in range(rest, d):
            turned = on_grid(row[j - rest], sc, zc, loc, hic)
            o[j] = on_grid(row[j] * c[j], s1, z1, lo1, hi1) + on_grid(turned * s[j], s4, z4, lo4, hi4)
        if rounded_sum:
            for j in range(d):
                o[j] = on_grid(o[j], s5, z5, lo5, hi5)
