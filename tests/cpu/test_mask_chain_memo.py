"""A decode step's attention-mask chain (Cast -> GatherND -> And -> Where from the dynamo exporter, Cast ->
Flatten -> Gather -> Reshape -> And -> Where from TorchScript) and its positions' chain (rotary Cos/Sin, a
position embedding's Gather) run once per mask, positions and feed shapes (session/mask_values.py): repeated
feeds return the kept values without running the chain, a changed mask or position at the same shapes runs it
again, and every output stays onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.session import canonical_feeds, mask_values, steps
from test_generate import _model

DECODERS = ["gpt2.dynamo.fp32", "gpt2.torchscript.fp32", "llama.dynamo.fp32", "llama.torchscript.fp32"]


@pytest.fixture(autouse=True)
def _general_values(monkeypatch):
    """The chain as padded feeds take it: all-ones masks and counting positions skip it (test_canonical_feeds)."""
    monkeypatch.setattr(canonical_feeds, "ENABLED", False)


def _feeds(session, past: int, mask: np.ndarray, rng) -> dict:
    feeds = {"input_ids": np.array([[int(rng.integers(1, 900))]], np.int64), "attention_mask": mask}
    names = [i.name for i in session.get_inputs()]
    if "position_ids" in names:
        feeds["position_ids"] = np.array([[past]], np.int64)
    for info in session.get_inputs():
        if "past" in info.name:
            feeds[info.name] = rng.standard_normal((1, info.shape[1], past, info.shape[3])).astype(np.float32)
    return feeds


@pytest.fixture
def chains(monkeypatch) -> tuple[list, list]:
    """(every MaskChain made from now on, one entry per run of a chain's steps)."""
    made, runs = [], []
    init, run = mask_values.MaskChain.__init__, mask_values.MaskChain.compute

    def recording_init(self, *args):
        init(self, *args)
        made.append(self)

    def counting_run(self, args):
        runs.append(self)
        return run(self, args)

    monkeypatch.setattr(mask_values.MaskChain, "__init__", recording_init)
    monkeypatch.setattr(mask_values.MaskChain, "compute", counting_run)
    return made, runs


@pytest.mark.parametrize("name", DECODERS)
def test_mask_chain_runs_once_per_mask_and_matches_onnxruntime(name, chains):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    path = _model(name)
    made, runs = chains
    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    ours = onnx_runtime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    oracle = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in oracle.get_outputs()]
    rng = np.random.default_rng(7)
    past = 9
    ones = np.ones((1, past + 1), np.int64)
    holes = ones.copy()
    holes[0, [1, 4]] = 0  # padding inside the window: the bias differs from the all-ones mask's
    base = _feeds(oracle, past, ones, rng)

    def check(mask, position: int | None = None) -> np.ndarray:
        feeds = dict(base, attention_mask=mask.copy())  # a fresh array each call, as a loop's feed is
        if position is not None:
            feeds["position_ids"] = np.array([[position]], np.int64)
        got = ours.run(outputs, feeds)
        want = oracle.run(outputs, feeds)
        for value, expected in zip(got, want):
            scale = max(1.0, float(np.abs(expected).max()))
            assert np.abs(value - expected).max() <= 2e-5 * scale
        return got[0]

    # The session's first feed shapes get a plan of their own; a decode loop's later lengths share the symbolic
    # one, whose body holds the chain.
    warm = _feeds(oracle, past - 1, np.ones((1, past), np.int64), rng)
    ours.run(outputs, warm)
    first = check(ones)  # new feed shapes: every step runs (and the shape-only values are kept)
    check(ones)  # the body: the chain runs (shapes new to it: nothing kept)
    assert made and not any(chain.kept for chain in made)
    check(ones)  # shapes met before: the chain runs and keeps its bias for this mask
    assert made and any({"Where"} <= {s.node.op_type for s in chain.steps} for chain in made)
    assert all(s.node.domain in ("", "ai.onnx") for chain in made for s in chain.steps)
    count = len(runs)
    assert count >= 1
    again = check(ones)
    assert len(runs) == count  # kept: the chain's steps did not run
    np.testing.assert_array_equal(again, first)
    padded = check(holes)  # the same shapes, another mask: runs, and is onnxruntime's
    assert len(runs) == count + 1
    assert np.abs(padded - first).max() > 1e-3
    check(ones)
    check(holes)
    assert len(runs) == count + 1  # both masks kept
    if "position_ids" in base:  # the positions' chain (rotary angles, position embeddings) is keyed the same way
        moved = check(ones, past + 3)
        assert len(runs) == count + 2
        assert np.abs(moved - first).max() > 1e-3
        check(ones, past + 3)
        check(ones)
        assert len(runs) == count + 2

    # The same session with the chain left ungrouped computes the same outputs, bit for bit.
    mask_values.ENABLED = False
    try:
        plain = onnx_runtime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    finally:
        mask_values.ENABLED = True
    for mask, position in ((ones, None), (holes, None), (holes, None), (ones, past + 3), (ones, None)):
        feeds = dict(base, attention_mask=mask.copy())
        if position is not None:
            feeds["position_ids"] = np.array([[position]], np.int64)
        for a, b in zip(plain.run(outputs, feeds), ours.run(outputs, feeds)):
            np.testing.assert_array_equal(a, b)


def _gpt2_dynamo():
    """A session of the zoo's dynamo GPT-2 and its output names."""
    ours = onnx_runtime.InferenceSession(_model("gpt2.dynamo.fp32"), providers=["CPUExecutionProvider"])
    return ours, [o.name for o in ours.get_outputs()]


def test_kept_bias_is_read_only_and_bounded(chains):
    made, _runs = chains
    ours, outputs = _gpt2_dynamo()
    rng = np.random.default_rng(3)
    for past in (3, 4, 5):
        base = _feeds(ours, past, np.ones((1, past + 1), np.int64), rng)
        for _ in range(3):
            ours.run(outputs, base)
    kept = [entry for chain in made for entry in chain.kept.values()]
    assert kept
    assert all(not r.flags.writeable for results in kept for r in results)
    chain = next(c for c in made if c.kept)
    before = len(chain.kept)
    chain.LIMIT = before  # a full table starts over rather than growing
    base = _feeds(ours, 5, np.array([[1, 0, 1, 1, 1, 1]], np.int64), rng)
    for _ in range(2):
        ours.run(outputs, base)
    assert len(chain.kept) == 1


def test_a_failing_chain_step_is_named_with_its_node(chains):
    made, _runs = chains
    ours, outputs = _gpt2_dynamo()
    rng = np.random.default_rng(5)
    for past in (3, 4, 4, 4):
        ours.run(outputs, _feeds(ours, past, np.ones((1, past + 1), np.int64), rng))
    chain = next(c for c in made if c.runs)
    victim = chain.steps[1]

    def broken(*_args):
        raise ValueError("broken kernel")

    broken_steps = list(chain.steps)
    broken_steps[1] = victim.replace(run=broken)
    chain.__init__(broken_steps, chain.inputs, chain.by_value, chain.outputs)  # (its loop is made from its steps)
    with pytest.raises(OnnxRuntimeError, match=f"{victim.node.name}.*broken kernel"):
        ours.run(outputs, _feeds(ours, 4, np.ones((1, 5), np.int64), rng))


@pytest.mark.parametrize("name", ["gpt2.torchscript.fp32", "llama.dynamo.fp32"])
def test_kept_shape_values_made_anew_still_find_the_chain(name, chains, monkeypatch):
    """The shape-only cache starting over makes its values anew: the chain is keyed by their bytes, not identity."""
    made, runs = chains
    monkeypatch.setattr(steps.ShapeValues, "LIMIT", 1)  # every new feed shape starts the shape-only cache over
    path = _model(name)
    ours = onnx_runtime.InferenceSession(path, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in ours.get_outputs()]
    rng = np.random.default_rng(11)
    feeds = {past: _feeds(ours, past, np.ones((1, past + 1), np.int64), rng) for past in (3, 9, 10)}
    ours.run(outputs, feeds[3])
    for _ in range(2):  # the second cycle keeps what the first only ran
        for past in (9, 10):
            for _ in range(2):
                ours.run(outputs, feeds[past])
    assert made and runs
    count = len(runs)
    for _ in range(3):
        for past in (9, 10):
            for _ in range(2):
                ours.run(outputs, feeds[past])
    assert len(runs) == count


def test_a_miss_runs_the_steps_over_their_own_slots():
    """A miss runs the chain's steps over its slots renumbered (inputs first, an omitted input's slot None):
    results by output slot whatever the plan's numbering, several outputs of one step, an omitted input."""
    from onnx_runtime.ir import Node

    def scaled(x, omitted):
        assert omitted is None
        return (x * 2,)

    def split(x, y):
        return x + y, x - y

    chain_steps = [
        steps.Step(scaled, (40, 0), (7,), (), Node("Mul", ["m", ""], ["s"], name="scaled"), "cpu"),
        steps.Step(split, (7, 12), (90, 3), (), Node("Add", ["s", "c"], ["p", "q"], name="split"), "cpu"),
    ]
    chain = mask_values.MaskChain(chain_steps, (40, 12), 1, (3, 7, 90))
    mask, constant = np.arange(5, dtype=np.int64), np.full(5, 3, np.int64)
    got = chain.compute((mask, constant))
    np.testing.assert_array_equal(got[0], mask * 2 - constant)
    np.testing.assert_array_equal(got[1], mask * 2)
    np.testing.assert_array_equal(got[2], mask * 2 + constant)
    single = mask_values.MaskChain(chain_steps, (40, 12), 1, (90,))
    (alone,) = single.compute((mask, constant))
    np.testing.assert_array_equal(alone, mask * 2 + constant)
