"""Loops a model makes endless or enormous: a run stops when its ``RunOptions.terminate`` is set from another
thread (fuzz seed 41's hang: onnx's loop16_seq_none case with a trip count of 2**62, each iteration growing a
loop-carried sequence), and scan outputs that the trip count would stack past the size budget fail after the
first iteration with the size asked."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime.errors import RunCancelledError, ShapeOverflowError


def _counting_loop(scan_elements: int = 0, outer_type: int = TensorProto.FLOAT) -> bytes:
    """Loop(M, cond, x) whose body adds 1 to x; with ``scan_elements`` > 0, each iteration also emits a scan
    output of that many float32 elements."""
    body_outputs = [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [1])]
    nodes = [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("Add", ["x_in", "one"], ["x_out"])]
    if scan_elements:
        nodes.append(helper.make_node("ConstantOfShape", ["shape"], ["scan"]))
        nodes.append(helper.make_node("Constant", [], ["shape"],
                                      value=helper.make_tensor("s", TensorProto.INT64, [1], [scan_elements])))
        body_outputs.append(helper.make_tensor_value_info("scan", TensorProto.FLOAT, [scan_elements]))
    body = helper.make_graph(nodes, "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [1])],
                             body_outputs)
    outputs = ["x_final"] + (["stacked"] if scan_elements else [])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["M", "cond", "x"], outputs, body=body)], "loop",
        [helper.make_tensor_value_info("M", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", outer_type, [1])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)]).SerializeToString()


def _feeds(trips: int) -> dict:
    return {"M": np.array(trips, np.int64), "cond": np.array(True), "x": np.zeros(1, np.float32)}


def test_loop_counts_as_asked():
    session = ort.InferenceSession(_counting_loop(), providers=["CPUExecutionProvider"])
    assert session.run(None, _feeds(7))[0].tolist() == [7.0]


def test_terminate_set_during_a_run_stops_an_endless_loop():
    session = ort.InferenceSession(_counting_loop(), providers=["CPUExecutionProvider"])
    run_options = ort.RunOptions()
    timer = threading.Timer(0.3, lambda: setattr(run_options, "terminate", True))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(RunCancelledError, match=r"\(Loop\) at iteration \d+ stopped: run_options.terminate"):
            session.run(None, _feeds(2**62), run_options)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 60
    # The flag cleared, the same session runs again.
    run_options.terminate = False
    assert session.run(None, _feeds(3), run_options)[0].tolist() == [3.0]


def test_one_runs_terminate_does_not_cancel_a_concurrent_run():
    # The flag is read through each run's own context: another thread's run on the same session finishes.
    session = ort.InferenceSession(_counting_loop(), providers=["CPUExecutionProvider"])
    run_options = ort.RunOptions()
    errors: list = []

    def endless():
        try:
            session.run(None, _feeds(2**62), run_options)
        except RunCancelledError as exc:
            errors.append(exc)

    thread = threading.Thread(target=endless)
    thread.start()
    time.sleep(0.2)
    run_options.terminate = True
    assert session.run(None, _feeds(50))[0].tolist() == [50.0]
    thread.join(60)
    assert not thread.is_alive() and len(errors) == 1


def test_scan_outputs_past_the_budget_fail_after_one_iteration():
    options = ort.SessionOptions()
    options.add_session_config_entry("session.max_value_bytes", str(64 << 20))
    session = ort.InferenceSession(_counting_loop(scan_elements=1024), options, providers=["CPUExecutionProvider"])
    started = time.process_time()
    with pytest.raises(ShapeOverflowError, match=r"scan output 0 over 1,099,511,627,776 iterations would take "
                                                 r"4,503,599,627,370,496 bytes"):
        session.run(None, _feeds(2**40))
    assert time.process_time() - started < 10
    stacked = session.run(None, _feeds(4))[1]
    assert stacked.shape == (4, 1024) and not stacked.any()


def test_a_loop_carried_value_of_another_type_than_the_body_declares_is_refused():
    # Fuzz seed 43 (Scan's state declared string, the body's float): the body's Add met a string, an internal
    # TypeError inside a KernelError. Like onnxruntime, the body's declared input types are checked first.
    session = ort.InferenceSession(_counting_loop(outer_type=TensorProto.DOUBLE), providers=["CPUExecutionProvider"])
    feeds = {**_feeds(3), "x": np.zeros(1, np.float64)}
    with pytest.raises(ort.errors.InvalidArgumentError,
                       match=r"\(Loop\): body input 'x_in' is declared FLOAT but is given float64"):
        session.run(None, feeds)


def test_a_scan_body_taking_more_values_than_the_node_gives_is_refused():
    # Fuzz seed 44: a Scan with two inputs and num_scan_inputs 1 gave its three-input body two values; the third
    # reached the body's Add as None (a TypeError inside a KernelError).
    def values(*names):
        return [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in names]

    body = helper.make_graph([helper.make_node("Add", ["s_in", "n"], ["s_out"]),
                              helper.make_node("Identity", ["m"], ["o"])], "body", values("s_in", "m", "n"),
                             values("s_out", "o"))
    graph = helper.make_graph([helper.make_node("Scan", ["s", "x"], ["y", "z"], body=body, num_scan_inputs=1)], "g",
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()
    with pytest.raises(ort.errors.InvalidGraphError, match=r"\(Scan\): attribute 'body' has 3 inputs; it must take 2"):
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        session.run(None, {"s": np.zeros(2, np.float32), "x": np.ones((3, 2), np.float32)})


def test_a_scan_body_returning_fewer_values_than_the_node_has_states_is_refused():
    # Fuzz seed 62: num_scan_inputs lowered from 4 to 2 made three of five inputs states, but the body returned
    # two values; the second iteration shifted its inputs by one and a None reached the body's Cast (an
    # AttributeError inside a KernelError).
    def values(*names):
        return [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in names]

    body = helper.make_graph([helper.make_node("Add", ["a_in", "b_in"], ["a_out"]),
                              helper.make_node("Add", ["a_in", "x_t"], ["o"])], "body",
                             values("a_in", "b_in", "c_in", "x_t"),
                             values("a_out", "o"))
    scan = helper.make_node("Scan", ["a", "b", "c", "x"], ["y", "z"], body=body, num_scan_inputs=1)
    graph = helper.make_graph([scan], "g",
                              [*values("a", "b", "c"), helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()
    with pytest.raises(ort.errors.InvalidGraphError,
                       match=r"\(Scan\): attribute 'body' has 2 outputs; it must return each of the node's 3 states"):
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        session.run(None, {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(2, np.float32),
                           "x": np.ones((3, 2), np.float32)})
