"""The CPU provider's tuning knobs: the sizes at which its kernels change algorithm or split their work
across threads, and how many threads they use.

Each default names the commit that set it; the commit message (and benchmarks/RESULTS.md) says what
was measured.
Change them to experiment, or in tests to reach a path with small inputs::

    from onnx_runtime_ep_cpu import tuning

    with tuning.override(split_macs=1, threads=3):   # split even a tiny product, over three threads
        session.run(None, feeds)

For a whole process, set ``ONNX_RUNTIME_CPU_<KNOB>`` (e.g. ``ONNX_RUNTIME_CPU_SPLIT_MACS=1``) before
the provider is imported. Kernels read the knobs when they are built (a session's first run with a
shape) and when they split a call; knobs change how the work is done, never the result beyond float
rounding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from onnx_runtime.errors import InvalidArgumentError

_ENVIRONMENT_PREFIX = "ONNX_RUNTIME_CPU_"


# The defaults live on the class and a change on the one instance, a plain class: dataclasses would compile code
# for it (and import its own module) in every new process.
class Knobs:
    """Every knob, with its default. Sizes are in multiply-adds (macs), elements or bytes."""

    # -- threads ------------------------------------------------------------------------------------
    #: Threads a split kernel uses, the caller's included; None: the session's intra_op_num_threads
    #: (threads.py), by default one per CPU this process may use.
    threads: int | None = None
    #: Helper threads the split kernels start (once per process); None: one per other usable CPU.
    helpers: int | None = None
    #: numpy's BLAS pool (OpenBLAS's own threads, which spin and wait on a shared CPU): one by default,
    #: the split kernels use the other CPUs.
    blas_threads: int = 1
    #: Below this many multiply-adds per thread a convolution or product stays on one thread: the
    #: hand-off to a helper costs more than it saves (0f3b016).
    split_macs: int = 1 << 20
    #: From this many multiply-adds per thread (milliseconds of work), a part waits for a sleeping helper
    #: rather than running alone, so the helper is awake for the next part (measured in 8f78cef).
    long_macs: int = 1 << 28
    #: Below this much work (input elements) a kernel split by planes or channels (pooling, batch
    #: normalization) stays on one thread (39c4fd8).
    split_elements: int = 1 << 16
    #: Below this many multiply-adds per image (input or output elements, whichever is more, times taps) a
    #: depthwise convolution of one image stays on one thread: since its in-place window loops (d57ce75) a
    #: mobilenet's small layers finish on the caller sooner than a helper's hand-off pays back (measured in
    #: the commit that set it; before, split_elements decided).
    split_depthwise_macs: int = 1 << 20
    #: Tasks per thread's share of a packed convolution, claimed one at a time, so that a thread done
    #: first takes what a slower one (a CPU shared with another process) has not started (measured in
    #: 08cafa2).
    conv_tasks_per_thread: int = 4
    #: The same for the packed products; cut finer, a prefill measured slower on a quiet machine (25f146c).
    product_tasks_per_thread: int = 1
    #: Few-row products (compiled/gemv.py) of at least this many weights are split across the threads;
    #: smaller ones take BLAS on one thread, which the split's handoff to a helper made slower with or
    #: without another process on the CPUs (measured in the commit that set it; baa9e65 before).
    gemv_split_weights: int = 1 << 20
    #: From this many weights per thread a few-row product's part waits for a sleeping helper (8f78cef).
    gemv_long_weights: int = 1 << 24
    #: From this size an image's padded copy for the packed convolution is split across the helpers
    #: (a memory-bound copy: the second core's bandwidth; measured in 91616ec).
    split_pad_bytes: int = 1 << 16

    # -- algorithm choice ----------------------------------------------------------------------------
    #: im2col writes its column matrix one block of output rows at a time, about an L2 cache per block
    #: (909bafb).
    im2col_block_bytes: int = 1 << 22
    #: Column-buffer block of the per-channel depthwise convolution (tiny products: a cache-sized buffer;
    #: 1880a80).
    depthwise_block_bytes: int = 1 << 19
    #: From this column-matrix size, stride-1 convolutions take per-tap products accumulated in BLAS
    #: instead of im2col (the column matrix would stream through memory; measured in afcca01).
    taps_column_bytes: int = 12 << 20
    #: A strided window runs over its input split into the stride's phases from this many multiply-adds
    #: per input value (the split is a copy of the input; measured in 0e2d32d).
    phase_macs: int = 500
    #: Phase-split inputs up to this size are kept per node and thread, their zero pads written once
    #: (a bound on the memory kept; 01b5c9a).
    kept_padded_bytes: int = 1 << 20
    #: On AVX2 hosts (no AVX-512), 2-D float32 convolutions of up to this many multiply-adds per image run
    #: compiled/directconv.py's tiles (on one thread); larger ones the BLAS paths, which split across threads.
    direct_macs: int = 1 << 27
    #: A decode step's attention of up to this many multiply-adds runs one compiled call; beyond, BLAS's
    #: batched products are faster (measured in 950a522).
    few_query_macs: int = 1 << 16
    #: Float32 products of constant weights with fewer multiply-adds than this take BLAS and the compiled
    #: epilogue instead of the packed product (compiled/matmul.py), whose call costs a few microseconds more
    #: (its compiled caller's many arguments): a short sequence's products through 64-wide layers.
    packed_macs: int = 1 << 19
    #: A short sequence's contrib Attention node (its Q/K/V product and its scores and weighted sums) of at least
    #: this many multiply-adds runs as one job per group of heads when more threads are set
    #: (compiled/attention_groups.py); below, on the calling thread: the hand-off costs a few microseconds.
    #: Off unless set (e.g. ``ONNX_RUNTIME_CPU_ATTENTION_GROUP_MACS=524288``): on a 2-core host the split gained
    #: nothing on a quiet machine and made more slow calls, its heads' Q/K/V moving between the cores.
    attention_group_macs: int = 1 << 62
    #: A few-row product that runs on one thread (one thread set, or too few weights to split) takes BLAS
    #: below this many multiply-adds: there compiled/gemv.py's loops are no faster and cost about a
    #: microsecond more per call (a decode step's 64-wide products: 1.7-3.7 us against BLAS's 0.9-3.0).
    few_rows_blas_macs: int = 1 << 22
    #: A few-row product of constant weights on one thread takes compiled/few_rows.py's tiles from this many
    #: multiply-adds, BLAS below (its call costs less there, and from about here on OpenBLAS packs the weights
    #: on every call; measured in the commit that set it).
    few_rows_packed_macs: int = 1 << 20
    #: The same for two or more rows by transposed weights (Gemm's transB), where OpenBLAS's strided packing
    #: makes it several times slower from much smaller sizes.
    few_rows_transposed_macs: int = 1 << 16
    #: A one-row product (a decode step's) of constant weights with a reduction of at least
    #: products.ONE_ROW_DEPTH takes few_rows.py's tiles from this many weights, below few_rows_packed_macs: a decode
    #: step streams every layer's weights, so a matrix this size comes from the L3 cache, where the tiles' streams
    #: over the packed panels beat OpenBLAS's call (which packs the weights, or walks them with a stride) by
    #: 1.2-2.6x; from the L2 cache BLAS is ~10% faster (measured in the commit that set it).
    one_row_tile_weights: int = 1 << 16


KNOBS = Knobs()
KNOB_NAMES = tuple(Knobs.__annotations__)  # every knob, in the order above
_on_change: list[Callable[[], None]] = []
# Bumped whenever a knob changes: a kernel that keeps a call (a bound product, a kept contrib call) holds the epoch
# it kept it in, since the path it keeps was chosen with the knobs.
knobs_epoch = [0]


def when_changed(clear: Callable[[], None]) -> None:
    """Call ``clear`` (a cache's clear method) whenever a knob changes: kernels cache decisions made
    with the knobs (how a shape of product is split, for one)."""
    _on_change.append(clear)


def _set(changes: dict) -> None:
    names = set(KNOB_NAMES)
    unknown = sorted(set(changes) - names)
    if unknown:
        raise InvalidArgumentError(
            f"unknown CPU tuning knob(s) {unknown}; the knobs are {sorted(names)} (onnx_runtime_ep_cpu/tuning.py)")
    for name, value in changes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidArgumentError(f"CPU tuning knob {name!r} is {value!r}; expected a positive integer")
        setattr(KNOBS, name, value)
    knobs_epoch[0] += 1
    for clear in _on_change:
        clear()


@contextlib.contextmanager
def override(**changes: int | None) -> Iterator[Knobs]:
    """Set the given knobs for the ``with`` block (the process's kernels all see them), then restore them."""
    before = {name: getattr(KNOBS, name) for name in KNOB_NAMES}
    _set(changes)
    try:
        yield KNOBS
    finally:
        _set(before)


def _from_environment(environ) -> dict:
    changes = {}
    for name in KNOB_NAMES:
        text = environ.get(_ENVIRONMENT_PREFIX + name.upper())
        if text is not None:
            try:
                changes[name] = int(text)
            except ValueError:
                raise InvalidArgumentError(
                    f"{_ENVIRONMENT_PREFIX}{name.upper()}={text!r}: expected an integer") from None
    return changes


_set(_from_environment(os.environ))
