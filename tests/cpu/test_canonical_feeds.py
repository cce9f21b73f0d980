"""An unpadded generation's attention mask (all ones) and position ids (counting up to the mask's length) as their
shapes make them (session/canonical_feeds.py): a first generation's new lengths get the bias, rotary angles and
position embeddings from the shape program instead of running the mask chain, every output stays onnxruntime's,
and padded batches or positions that do not count up take the chain as before."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from model_helpers import zoo_model
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.session import canonical_feeds, mask_values
from test_generate import _model

DECODERS = ["gpt2.dynamo.fp32", "gpt2.torchscript.fp32", "llama.dynamo.fp32", "llama.torchscript.fp32"]


def _feeds(session, past: int, batch: int, rng, left_pad: int = 0) -> dict:
    """A decode step's feeds: row 0 unpadded; with ``left_pad``, the last row's first positions are padding (zeros
    in its mask, positions counted from its first real token, as a generation loop over a padded batch makes)."""
    mask = np.ones((batch, past + 1), np.int64)
    positions = np.full((batch, 1), past, np.int64)
    if left_pad:
        mask[-1, :left_pad] = 0
        positions[-1, 0] = past - left_pad
    feeds = {"input_ids": rng.integers(1, 900, (batch, 1)).astype(np.int64), "attention_mask": mask}
    names = [i.name for i in session.get_inputs()]
    if "position_ids" in names:
        feeds["position_ids"] = positions
    for info in session.get_inputs():
        if "past" in info.name:
            feeds[info.name] = rng.standard_normal((batch, info.shape[1], past, info.shape[3])).astype(np.float32)
    return feeds


def _sessions(name: str):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    path = _model(name)
    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    return (onnx_runtime.InferenceSession(path, options, providers=["CPUExecutionProvider"]),
            ort.InferenceSession(path, providers=["CPUExecutionProvider"]))


def _close(ours, oracle, outputs, feeds) -> None:
    for value, expected in zip(ours.run(outputs, feeds), oracle.run(outputs, feeds)):
        scale = max(1.0, float(np.abs(expected).max()))
        assert np.abs(value - expected).max() <= 2e-5 * scale


@pytest.fixture
def chain_runs(monkeypatch) -> list:
    """One entry per run of a mask chain's steps."""
    runs: list = []
    compute = mask_values.MaskChain.compute

    def counting(self, args):
        runs.append(self)
        return compute(self, args)

    monkeypatch.setattr(mask_values.MaskChain, "compute", counting)
    return runs


def _values(ours, feeds):
    plans = ours._executor_for(ours._validate_feeds(feeds))._plans  # noqa: SLF001  (white box: the plan's values)
    return next(iter(plans.values())).shape_values


@pytest.mark.parametrize("name", DECODERS)
def test_a_first_generation_runs_no_mask_chain_and_matches_onnxruntime(name, chain_runs):
    ours, oracle = _sessions(name)
    outputs = [o.name for o in oracle.get_outputs()]
    rng = np.random.default_rng(3)
    for past in range(4, 8):  # the session's first shapes, then the symbolic plan's first ones
        ours.run(outputs, _feeds(oracle, past, 1, rng))
    chain_runs.clear()
    for past in range(8, 40):  # every length new to the session, as a user's first generation
        _close(ours, oracle, outputs, _feeds(oracle, past, 1, rng))
    assert not chain_runs
    values = _values(ours, _feeds(oracle, 20, 1, rng))
    assert isinstance(values, canonical_feeds.CanonicalFeeds)
    # The bias, rotary angles and position embeddings are the program's: no step left to run per call.
    programs = [(program, residual) for _, program, residual in values.canonical.programs if program is not None]
    assert programs and not any(residual.steps for _, residual in programs)
    for past in range(8, 40):  # a second generation through the same lengths: kept per shapes
        _close(ours, oracle, outputs, _feeds(oracle, past, 1, rng))
    assert not chain_runs


@pytest.mark.parametrize("name", DECODERS)
def test_padded_batches_take_the_chain_and_match_onnxruntime(name, chain_runs):
    ours, oracle = _sessions(name)
    outputs = [o.name for o in oracle.get_outputs()]
    rng = np.random.default_rng(5)
    for past in range(4, 8):
        ours.run(outputs, _feeds(oracle, past, 2, rng, left_pad=2))
    chain_runs.clear()
    for past in range(8, 24):  # a padded batch, then the same lengths unpadded: one cache must not serve the other
        _close(ours, oracle, outputs, _feeds(oracle, past, 2, rng, left_pad=3))
        _close(ours, oracle, outputs, _feeds(oracle, past, 2, rng))
    assert len(chain_runs) >= 16  # the padded calls (the unpadded ones take the program's values)


@pytest.mark.parametrize("name", DECODERS)
def test_prefills_and_chunks_of_several_tokens_match_onnxruntime(name):
    """Several new tokens per call (a prefill without a past, chunks after one, batches of 2, a padded row): the
    positions count along their axis, and each call is onnxruntime's."""
    ours, oracle = _sessions(name)
    outputs = [o.name for o in oracle.get_outputs()]
    rng = np.random.default_rng(11)
    names = [i.name for i in oracle.get_inputs()]
    for past, count, batch, pad in [(0, n, 1, 0) for n in range(3, 12)] + [(p, 4, 2, 0) for p in range(5, 14)] \
            + [(p, 3, 2, 2) for p in range(5, 10)]:
        feeds = {"input_ids": rng.integers(1, 900, (batch, count)).astype(np.int64),
                 "attention_mask": np.ones((batch, past + count), np.int64)}
        positions = np.tile(np.arange(past, past + count), (batch, 1))
        if pad:
            feeds["attention_mask"][-1, :pad] = 0
            positions[-1] = np.maximum(positions[-1] - pad, 0)
        if "position_ids" in names:
            feeds["position_ids"] = positions
        for info in oracle.get_inputs():
            if "past" in info.name:
                feeds[info.name] = rng.standard_normal((batch, info.shape[1], past, info.shape[3])).astype(np.float32)
        _close(ours, oracle, outputs, feeds)


def test_a_position_past_the_embedding_table_is_still_an_error(chain_runs):
    ours, oracle = _sessions("gpt2.dynamo.fp32")
    outputs = [o.name for o in oracle.get_outputs()]
    table = next(i for i in oracle.get_inputs() if "past" in i.name)
    rng = np.random.default_rng(9)
    limit = 128  # the zoo GPT-2's positions
    for past in range(limit - 12, limit):  # up to the table's last row: the program's window is cut there
        _close(ours, oracle, outputs, _feeds(oracle, past, 1, rng))
    assert table is not None and not chain_runs
    with pytest.raises(OnnxRuntimeError):
        ours.run(outputs, _feeds(oracle, limit, 1, rng))


@pytest.mark.parametrize("name", ["t5_decoder.dynamo.fp32", "t5_decoder.torchscript.fp32"])
def test_a_bias_the_same_at_every_length_is_one_read_only_array(name, chain_runs):
    """T5's encoder mask does not grow with the decoder's past: its bias is the program's value at every point, made
    once and handed out as one read-only array (kernels that key what they derive by identity keep reusing it)."""
    entry, path = zoo_model(name)
    import zoo_feeds

    ours, oracle = _sessions(name)
    outputs = [o.name for o in oracle.get_outputs()]
    feeds = [zoo_feeds.make_feeds(zoo_feeds.grown(entry["calls"]["decode"], extra)) for extra in range(14)]
    for step in feeds[:4]:
        ours.run(outputs, step)
    for step in feeds[4:]:
        _close(ours, oracle, outputs, step)
    assert not chain_runs
    values = _values(ours, feeds[-1])
    programs = [program for _, program, _ in values.canonical.programs if program is not None]
    fixed = [value for _, value, row in programs[-1].recipes if row is not None and row < 0]
    assert fixed and all(isinstance(value, np.ndarray) and not value.flags.writeable for value in fixed)
    moving = [row for _, _, row in programs[-1].recipes if row is not None and row >= 0]
    assert moving  # (the decoder's own causal bias and relative positions still move with the length)


def test_holds_checks_the_bytes():
    both = canonical_feeds.CanonicalFeeds(None, None, (0,), ((1, 0),))
    ones = np.ones((1, 9), np.int64)
    assert both.holds([ones, np.array([[8]])])
    assert both.holds([ones.astype(bool), np.array([[8]], np.int32)])
    assert both.holds([np.ones((2, 9), np.int32), np.array([[6, 7, 8], [6, 7, 8]])])
    assert both.holds([np.ones((1, 70000), np.int64), np.array([[69999]])])  # past the first grown buffers
    holes = ones.copy()
    holes[0, 2] = 0
    assert not both.holds([holes, np.array([[8]])])
    assert not both.holds([ones, np.array([[7]])])
    assert not both.holds([np.ones((2, 9), np.int64), np.array([[6, 7, 8], [5, 6, 7]])])
    assert not both.holds([ones, np.arange(10).reshape(1, 10)])  # more positions than the mask's length
    assert not both.holds([ones, np.array([[8.0]])])
    assert not both.holds([[1] * 9, np.array([[8]])])


def test_holds_compares_every_byte_of_the_mask_with_the_longer_ones_kept():
    """The mask's bytes are compared as a prefix of the ones kept for longer masks: an entry anywhere that is not
    1 (first, last, a value whose low byte is 1) fails, at lengths below and past the kept ones' size."""
    both = canonical_feeds.CanonicalFeeds(None, None, (0,), ((1, 0),))
    for length in (1, 9, 8192, 8193, 70000):
        positions = np.array([[length - 1]])
        assert both.holds([np.ones((1, length), np.int64), positions])
        assert both.holds([np.ones((1, 2 * length), np.int64)[:, ::2], positions])  # (a strided view)
        for at, value in ((0, 0), (length - 1, 0), (length - 1, 257), (length // 2, -1)):
            mask = np.ones((1, length), np.int64)
            mask[0, at] = value
            assert not both.holds([mask, positions]), (length, at, value)
    assert not both.holds([np.ones((1, 9), np.uint8) * 2, np.array([[8]])])


def test_holds_checks_every_mask_and_position_feed_it_was_made_for():
    """Two masks (one int64, one bool) with a position feed each: every one is checked, against its own mask."""
    both = canonical_feeds.CanonicalFeeds(None, None, (0, 2), ((1, 0), (3, 2)))
    good = [np.ones((1, 9), np.int64), np.array([[8]]), np.ones((2, 5), bool), np.array([[3, 4], [3, 4]], np.int32)]
    assert both.holds(good)
    for index, bad in ((0, np.ones((1, 10), np.int64)), (1, np.array([[4]])), (2, np.eye(2, 5, dtype=bool)),
                       (3, np.array([[3, 4], [2, 3]], np.int32)), (3, np.array([[7]])), (2, [[True] * 5] * 2)):
        assert not both.holds(good[:index] + [bad] + good[index + 1:]), index
