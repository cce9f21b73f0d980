"""1-D float32 convolutions (Whisper's and wav2vec's audio front ends) run as 2-D ones over a single row.

conv_path chooses among 2-D algorithms only: a 1-D convolution would take im2col through numpy's strided
copy and BLAS, where the packed convolution and the direct tiles compute the same window on an (N, C, 1, L)
view of the input straight from the padded row (Whisper's front-end layers, with and without a stride: measured in
this module's commit). The views cost no copy; the weight's view is kept while the same constant comes in,
because the 2-D algorithms keep their rearranged weights per weight object (Prepared keys on identity).
"""

from __future__ import annotations

import numpy as np

from .window import Geometry

_FLOAT32 = np.dtype(np.float32)


def lifts(x: np.ndarray, w: np.ndarray) -> bool:
    """Whether a convolution of ``x`` by ``w`` runs as a 2-D one over a single row: 1-D float32."""
    return x.ndim == 3 and w.ndim == 3 and x.dtype is _FLOAT32


def as_row(x: np.ndarray) -> np.ndarray:
    """(N, C, L) as (N, C, 1, L): a view where x is contiguous along L's rows, as reshape gives it."""
    return x.reshape(x.shape[0], x.shape[1], 1, x.shape[2])


def row_geometry(geo: Geometry) -> Geometry:
    """The 2-D geometry of a 1-D window over a single row (height 1, no vertical pads or steps)."""
    return Geometry((1, *geo.in_shape), (1, *geo.kernel), (1, *geo.strides), (1, *geo.dilations), (0, *geo.begin),
                    (0, *geo.end), (1, *geo.out))


class RowWeights:
    """The (M, C/G, 1, K) view of a 1-D weight, kept while the same read-only array comes in."""

    __slots__ = ("_held",)

    def __init__(self):
        self._held: tuple = (None, None)

    def __call__(self, w: np.ndarray) -> np.ndarray:
        held, view = self._held  # one read: another thread may swap in a new pair meanwhile
        if held is w:
            return view
        view = as_row(w)
        if not w.flags.writeable:
            self._held = (w, view)
        return view
