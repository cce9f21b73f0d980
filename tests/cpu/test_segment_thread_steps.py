"""A segment plan's steps that split across threads as the nodes' kernels do (ShuffleNet at 224x224, one segment):
a grouped convolution that no blocked tiles take shares its groups with the helpers as claimed tasks
(conv_direct.DirectConv's group tasks, jobs.DIRECT), a large pool its planes (jobs.POOL) and a large depthwise
convolution its channels (jobs.split_depthwise); before, the pool and the depthwise convolution ran their kernels
and copied the result (a plan past COPY_LIMIT_BYTES of such copies is not made). Each split computes what one
thread's call does: the values equal a one-thread session's, bit for bit, and stay within a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import session as session_module
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.ops.segment import Segment
from reference64 import run_float64
from test_batch_readonly_feeds import watch_segments


def _unit(groups: int = 4, per_group: int = 12, size: int = 24):
    """A ShuffleNet-like unit on a large map: a 3x3/2 max pool, a grouped 1x1 convolution (groups of 12 channels:
    no blocked tiles), its Relu, a 3x3 depthwise convolution, another grouped 1x1 one."""
    c = groups * per_group
    rng = np.random.default_rng(c)
    inits = [numpy_helper.from_array((rng.standard_normal((c, per_group, 1, 1)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((c, 1, 3, 3)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal((c, per_group, 1, 1)) * 0.3).astype(np.float32), "w3")]
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["c1"], group=groups),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=c),
             helper.make_node("Conv", ["c2", "w3"], ["y"], group=groups)]
    graph = helper.make_graph(nodes, "unit", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            [1, c, 2 * size, 2 * size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _session(model, threads):
    options = session_module.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    return session_module.InferenceSession(model.SerializeToString(), sess_options=options)


def _matches_one_thread(model, x, want, runs: int) -> None:
    """``runs`` runs of a two-thread session: each the one-thread ``want`` bit for bit, within a float64 reference."""
    two = _session(model, 2)
    for _ in range(runs):
        (got,) = two.run(None, {"x": x})
        np.testing.assert_array_equal(got, want)
    (exact,) = run_float64(model, {"x": x})
    assert np.abs(got - exact).max() <= 1e-5 * (1 + np.abs(exact).max())


def _step_names(plan) -> list[str]:
    from onnx_runtime_ep_cpu.compiled import jobs, workers

    kinds = {id(jobs.DIRECT): "direct", id(jobs.POOL): "pool"}
    names = []
    for function, arguments in plan._steps:  # noqa: SLF001
        name = getattr(function, "__name__", "")
        if function is workers.run:  # (kind, parts, helpers)
            name = f"{kinds.get(id(arguments[0]), '?')} x{len(arguments[1])}"
        names.append(name)
    return names


@pytest.mark.parametrize("split", [False, True])
def test_a_plans_split_steps_compute_what_one_thread_does(monkeypatch, knobs, split):
    model = _unit()
    x = np.random.default_rng(3).standard_normal((1, 48, 48, 48)).astype(np.float32)
    made, _ = watch_segments(monkeypatch)
    one = _session(model, 1)
    for _ in range(3):
        (want,) = one.run(None, {"x": x})
    if split:  # every split taken, whatever this host's thresholds
        knobs(split_macs=1, split_elements=1, split_depthwise_macs=1)
    _matches_one_thread(model, x, want, runs=3)
    plans = [plan for segment in made[1:] for plans in segment.plans.values() for plan in (plans or ())]
    assert len(plans) == 1 and plans[0].describe()["kernels"] == 0, [p.describe() for p in plans]
    names = _step_names(plans[0])
    assert segment_steps._run_kernel.__name__ not in names  # noqa: SLF001
    if split:
        assert {"_claimed_groups", "pool x2", "_split_channels"} <= set(names), names


def test_a_late_helpers_group_tasks_are_claimed_by_the_caller(knobs):
    """A part whose thread never runs (here: every part run on the caller, one after another) leaves nothing
    undone, and each run's claims start from zero: the same values over several runs."""
    from onnx_runtime_ep_cpu.algorithms import conv_direct
    from onnx_runtime_ep_cpu.compiled import jobs

    knobs(split_macs=1, threads=2)
    model = _unit()
    x = np.random.default_rng(4).standard_normal((1, 48, 48, 48)).astype(np.float32)
    (want,) = _session(model, 1).run(None, {"x": x})
    calls = []

    def alone(parts):  # the caller's part first, which claims every task; the helper's finds none left
        calls.append(len(parts))
        parts[0][-2][:] = 0
        for part in parts:
            jobs.DIRECT.here(part)

    real = conv_direct._claimed_groups  # noqa: SLF001
    conv_direct._claimed_groups = alone  # noqa: SLF001  (bound into the plan made below)
    try:
        sess = _session(model, 2)
        for _ in range(4):
            (got,) = sess.run(None, {"x": x})
            np.testing.assert_array_equal(got, want)
    finally:
        conv_direct._claimed_groups = real  # noqa: SLF001
    assert calls and all(count == 2 for count in calls)


def _activations(excite: bool, c: int = 24, size: int = 20):
    """Activations and a residual sum between pointwise convolutions: a SiLU (Sigmoid and Mul), a Sigmoid, a
    HardSigmoid, a HardSwish and an Add, each a segment_loops loop of the plan (over blocked values); where ``excite``,
    a squeeze-excitation block (GlobalAveragePool, 1x1 convolution, Relu, 1x1 convolution, Sigmoid, Mul) after the
    sum, which is an output too: a plain value, whose block is the plain squeeze_excite loop."""
    rng = np.random.default_rng(c)
    inits = [numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) * 0.3).astype(np.float32), f"w{i}")
             for i in range(3)]
    inits += [numpy_helper.from_array((rng.standard_normal((8, c, 1, 1)) * 0.3).astype(np.float32), "squeeze"),
              numpy_helper.from_array((rng.standard_normal((c, 8, 1, 1)) * 0.3).astype(np.float32), "excite")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"]),
             helper.make_node("Sigmoid", ["c0"], ["s0"]), helper.make_node("Mul", ["c0", "s0"], ["silu"]),
             helper.make_node("Conv", ["silu", "w1"], ["c1"]), helper.make_node("Sigmoid", ["c1"], ["s1"]),
             helper.make_node("HardSigmoid", ["s1"], ["h1"], alpha=0.3, beta=0.4),
             helper.make_node("HardSwish", ["h1"], ["h2"]), helper.make_node("Add", ["h2", "silu"], ["sum"])]
    last, outputs = "sum", ["y"]
    if excite:
        nodes += [helper.make_node("GlobalAveragePool", ["sum"], ["pooled"]),
                  helper.make_node("Conv", ["pooled", "squeeze"], ["sq"]), helper.make_node("Relu", ["sq"], ["sr"]),
                  helper.make_node("Conv", ["sr", "excite"], ["ex"]), helper.make_node("Sigmoid", ["ex"], ["gate"]),
                  helper.make_node("Mul", ["sum", "gate"], ["se"])]
        last, outputs = "se", ["y", "sum"]
    nodes.append(helper.make_node("Conv", [last, "w2"], ["y"]))
    graph = helper.make_graph(nodes, "activations",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, size, size])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("excite", [False, True])
def test_a_plans_elementwise_steps_split_as_claimed_ranges(monkeypatch, knobs, excite):
    """At two threads a plan's activations and residual sum over at least split_elements values are claimed ranges
    of jobs.ELEMENTWISE, or shared rows of the chain that runs them (segment_chain's split), and a plain
    squeeze-excitation block's means and scaling claimed spans of planes (MEANS, SCALE) around its gates
    (segment_elementwise.py): the one-thread plan's values bit for bit, run after run; at one thread they stay single
    loops."""
    from onnx_runtime_ep_cpu.algorithms import segment_elementwise
    from onnx_runtime_ep_cpu.compiled import jobs

    model = _activations(excite)
    x = np.random.default_rng(5).standard_normal((1, 24, 20, 20)).astype(np.float32)
    made, _ = watch_segments(monkeypatch)
    knobs(split_elements=1)  # (every loop of these small maps split)
    one = _session(model, 1)
    for _ in range(3):
        want = one.run(None, {"x": x})
    two = _session(model, 2)
    for _ in range(4):
        got = two.run(None, {"x": x})
        for ours, theirs in zip(got, want):
            np.testing.assert_array_equal(ours, theirs)
    for ours, exact in zip(got, run_float64(model, {"x": x})):
        assert np.abs(ours - exact).max() <= 1e-5 * (1 + np.abs(exact).max())
    plans = [[plan for plans in segment.plans.values() for plan in (plans or ())] for segment in made]
    assert [len(found) for found in plans] == [1, 1]
    calls = plans[1][0]._calls  # noqa: SLF001
    splits = [arguments[0] for function, arguments in calls if function is segment_elementwise._claimed_ranges]  # noqa: SLF001
    assert all(len(parts) == 2 for parts in splits)
    loops = {parts[0][0] for parts in splits} | _chain_shared_loops(calls)
    planes = [parts[0][0] for parts in splits if parts[0][0] in (jobs.MEANS, jobs.SCALE)]
    if excite:
        assert {jobs.SWISH, jobs.SIGMOID, jobs.HARD_SIGMOID} <= loops and planes == [jobs.MEANS, jobs.SCALE]
    else:
        assert {jobs.SWISH, jobs.SIGMOID, jobs.HARD_SIGMOID, jobs.ADD} <= loops and not planes
    assert not any(function is segment_elementwise._claimed_ranges for function, _ in plans[0][0]._calls)  # noqa: SLF001
    assert not _chain_shared_loops(plans[0][0]._calls)  # noqa: SLF001


def _chain_shared_loops(calls) -> set:
    """The jobs.ELEMENTWISE codes of the elementwise rows a plan's chains share with the helpers (segment_chain's
    split: run_chain_threads' ``splits``); the blocked-layout steps of these models run in chains."""
    from onnx_runtime_ep_cpu.algorithms import segment_chain
    from onnx_runtime_ep_cpu.compiled import jobs

    codes = {segment_chain._KINDS[name][0]: code for name, code in (  # noqa: SLF001
        ("swish_float32_into", jobs.SWISH), ("sigmoid_float32_into", jobs.SIGMOID),
        ("hard_sigmoid_into", jobs.HARD_SIGMOID), ("add_float32_into", jobs.ADD))}
    found = set()
    for function, arguments in calls:
        if getattr(function, "__name__", "") == "run_chain_threads":
            table, _, splits = arguments[:3]
            found |= {codes[int(table[r, 0])] for r in range(len(table)) if splits[r, 1] >= 2}
    return found


def test_elementwise_ranges_cover_every_value_once():
    """The ranges start on cache lines and cover the values in order, however many values (a tail shorter than a
    line included)."""
    from onnx_runtime_ep_cpu.algorithms.segment_elementwise import _split  # noqa: PLC2701
    from onnx_runtime_ep_cpu.compiled import jobs

    for size in (16, 17, 1000, 65537):
        x, y = np.zeros(size, np.float32), np.zeros(size, np.float32)
        _, (parts,) = _split(jobs.SIGMOID, (x, y), 2)
        cuts = parts[0][7]
        assert cuts[0] == 0 and cuts[-1] == size and (np.diff(cuts) >= 0).all() and (cuts[:-1] % 16 == 0).all()


def _fire(c: int = 64, squeezed: int = 16, size: int = 56):
    """A SqueezeNet fire module on a large map: a 3x3/2 max pool, the squeeze (an ungrouped 1x1 convolution to 16
    channels with its bias and Relu: one 16-channel tile, so only its rows can split), the two expansions (1x1 and
    3x3, each with its Relu) and their concatenation."""
    rng = np.random.default_rng(c)
    half = c // 2
    inits = [numpy_helper.from_array((rng.standard_normal((squeezed, c, 1, 1)) * 0.2).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(squeezed).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((half, squeezed, 1, 1)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array((rng.standard_normal((half, squeezed, 3, 3)) * 0.1).astype(np.float32), "w3")]
    nodes = [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r1", "w3"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Concat", ["r2", "r3"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            [1, c, 2 * size + 1, 2 * size + 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("late_helper", [False, True])
def test_an_ungrouped_pointwise_convolution_shares_its_rows(monkeypatch, knobs, late_helper):
    """A plan's ungrouped convolution that reads its input in place (a pointwise one here) shares its row chunks
    with the helpers as claimed tasks (conv_direct.DirectConv's row tasks, jobs.DIRECT_ROWS); a helper that never
    runs leaves its tasks to the caller. The values equal a one-thread session's bit for bit over several runs,
    and stay within a float64 reference."""
    from onnx_runtime_ep_cpu.algorithms import conv_direct
    from onnx_runtime_ep_cpu.compiled import jobs

    model = _fire()
    x = np.random.default_rng(5).standard_normal((1, 64, 113, 113)).astype(np.float32)
    (want,) = _session(model, 1).run(None, {"x": x})
    knobs(split_macs=1, split_elements=1)
    made, _ = watch_segments(monkeypatch)
    calls = []
    if late_helper:
        def alone(parts):  # the caller's part first, which claims every task; the helper's finds none left
            calls.append(len(parts))
            parts[0][-2][:] = 0
            for part in parts:
                jobs.DIRECT_ROWS.here(part)

        monkeypatch.setattr(conv_direct, "_claimed_rows", alone)
    _matches_one_thread(model, x, want, runs=4)
    plans = [plan for segment in made for plans in segment.plans.values() for plan in (plans or ())]
    names = [name for plan in plans for name in _step_names(plan)]
    assert ("alone" if late_helper else "_claimed_rows") in names, names
    assert not late_helper or (calls and all(count == 2 for count in calls))


def test_a_concat_parts_unset_channels_do_not_fail_the_plans_check(monkeypatch):
    """A segment whose result is a Concat's first part (the fire module's squeeze and 1x1 expansion; the 3x3
    expansion, outside it, writes the rest) holds only that part's channels: the rest holds whatever its buffer
    held (freed memory reused: any bits, NaN included). The plan's check compares the channels it holds, so such a
    segment is planned; a difference in those still fails it."""
    watch_segments(monkeypatch)
    seen = []
    real = Segment._plan_and_run  # noqa: SLF001  (watch_segments' own wrapper)

    def plan_and_run(self, key, inputs):
        seen.append((self, list(inputs)))
        return real(self, key, inputs)

    monkeypatch.setattr(Segment, "_plan_and_run", plan_and_run)
    x = np.random.default_rng(6).standard_normal((1, 64, 113, 113)).astype(np.float32)
    session = _session(_fire(), 1)
    for _ in range(3):
        session.run(None, {"x": x})
    found = [(segment, inputs) for segment, inputs in seen
             if any("concat_part" in name for name in segment.output_names)]
    if not found:
        pytest.skip("this host's passes keep the fire module's expansions in one segment")
    segment, inputs = found[0]
    assert all(plans for plans in segment.plans.values()), "the segment was left to its nodes"
    part = next(i for i, name in enumerate(segment.output_names) if "concat_part" in name)
    env, outputs = segment._node_by_node(inputs, keep_all=True)  # noqa: SLF001
    planned = [np.array(value) for value in outputs]
    assert planned[part].shape[1] == 64  # (the whole Concat's buffer: 32 channels set here)
    outputs[part][:, 32:] = np.nan  # its unset channels: anything
    planned[part][:, 32:] = 1e30
    assert segment._agree(env, planned, outputs)  # noqa: SLF001
    planned[part][0, 31, 0, 0] += 1.0
    assert not segment._agree(env, planned, outputs)  # noqa: SLF001
