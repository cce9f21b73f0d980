"""Contract 1.3's counter-driven decode hooks (``device_token_writer_at``, ``device_copy_rows_at``): the step and the
position come from device memory, so a captured decode step replays them unchanged. On the CUDA provider (the
simulator) and on the contract's host defaults (the CPU provider), against a numpy reference of the same steps."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx_runtime.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_device_graphs import CountingDriver  # noqa: E402
from test_generate import PROMPT, _model, onnxruntime_greedy  # noqa: E402

CAPACITY = 6  # token slots
MASK = 12


def _cpu_handle():
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cpu import CPUExecutionProvider

    handle = ProviderHandle(CPUExecutionProvider())
    handle.initialize({})
    return handle


@pytest.fixture(params=["cuda", "cpu"])
def handle(request):
    if request.param == "cuda":
        yield request.getfixturevalue("cuda_handle")
        return
    handle = _cpu_handle()
    yield handle
    handle.shutdown()


class _Buffers:
    """Device buffers holding given host arrays, freed once at the end."""

    def __init__(self, handle):
        self.handle, self.owned = handle, []

    def __call__(self, array: np.ndarray):
        buffer = self.handle.allocate(max(array.nbytes, 1), 256)
        self.owned.append(buffer)
        self.handle.copy_from_host(np.ascontiguousarray(array).reshape(-1).view(np.uint8), buffer)
        return buffer

    def read(self, buffer, dtype, count: int) -> np.ndarray:
        return self.handle.download(buffer, count * np.dtype(dtype).itemsize).view(dtype).copy()

    def close(self) -> None:
        for buffer in self.owned:
            self.handle.deallocate(buffer)


def test_the_token_writer_reads_and_advances_its_counter(handle):
    buffers = _Buffers(handle)
    try:
        result = buffers(np.array([0, 0], np.uint32))
        ids, positions = buffers(np.zeros(1, np.int64)), buffers(np.zeros(1, np.int64))
        mask, scratch = buffers(np.zeros(MASK, np.int64)), buffers(np.zeros(CAPACITY + 1, np.uint32))
        counter = buffers(np.array([0, 4], np.int64))  # step 0, next position 4
        chosen = [7, 3, 9, 1, 5, 2]
        for token in chosen:
            handle.copy_from_host(np.array([token, 0], np.uint32).view(np.uint8), result)
            handle.hook.device_token_writer_at(result=result, input_ids=ids, position_ids=positions,
                                               attention_mask=mask, scratch=scratch, capacity=CAPACITY,
                                               mask_len=8, write_position=True, counter=counter)
        assert buffers.read(ids, np.int64, 1).tolist() == [chosen[-1]]
        assert buffers.read(positions, np.int64, 1).tolist() == [4 + len(chosen) - 1]
        assert buffers.read(mask, np.int64, MASK).tolist() == [0] * 4 + [1] * 4 + [0] * 4  # mask_len 8 guards it
        assert buffers.read(scratch, np.uint32, CAPACITY + 1).tolist() == chosen + [0]
        assert buffers.read(counter, np.int64, 2).tolist() == [CAPACITY, 4 + CAPACITY]
        # One step too many: nothing written but the overflow bit in the error word; the counter stays.
        handle.copy_from_host(np.array([8, 0], np.uint32).view(np.uint8), result)
        handle.hook.device_token_writer_at(result=result, input_ids=ids, position_ids=positions, attention_mask=mask,
                                           scratch=scratch, capacity=CAPACITY, mask_len=8, write_position=True,
                                           counter=counter)
        assert buffers.read(scratch, np.uint32, CAPACITY + 1).tolist() == chosen + [0x80000000]
        assert buffers.read(ids, np.int64, 1).tolist() == [chosen[-1]]
        assert buffers.read(counter, np.int64, 2).tolist() == [CAPACITY, 4 + CAPACITY]
        with pytest.raises(InvalidArgumentError, match="counter"):
            handle.hook.device_token_writer_at(result=result, input_ids=ids, position_ids=positions,
                                               attention_mask=mask, scratch=scratch, capacity=CAPACITY, mask_len=8,
                                               write_position=True, counter=buffers(np.zeros(1, np.int64)))
    finally:
        buffers.close()


def test_rows_land_at_the_index_the_counter_names(handle):
    rng = np.random.default_rng(3)
    heads, capacity, row = 3, 5, 24  # 24-byte rows: the word path; 6-byte units below: the byte path
    buffers = _Buffers(handle)
    try:
        src = rng.integers(0, 255, heads * 2 * row, dtype=np.uint8)
        source, target = buffers(src), buffers(np.zeros(heads * capacity * row, np.uint8))
        counter = buffers(np.array([0, 3], np.int64))
        want = np.zeros(heads * capacity * row, np.uint8)
        for position, bias in ((3, -1), (3, 0), (4, 0), (9, 0), (3, -4)):  # the last two: out of range, no copy
            handle.copy_from_host(np.array([0, position], np.int64).view(np.uint8), counter)
            handle.hook.device_copy_rows_at(src=source, src_offset=row, src_pitch=2 * row, dst=target,
                                            dst_pitch=capacity * row, row_bytes=row, rows=heads, counter=counter,
                                            word=1, bias=bias, dst_unit=row, limit=capacity)
            index = position + bias
            if 0 <= index < capacity:
                for head in range(heads):
                    at = (head * capacity + index) * row
                    want[at: at + row] = src[(2 * head + 1) * row: (2 * head + 2) * row]
        np.testing.assert_array_equal(buffers.read(target, np.uint8, want.size), want)
        odd = buffers(np.zeros(40, np.uint8))
        handle.hook.device_copy_rows_at(src=source, src_offset=1, src_pitch=7, dst=odd, dst_pitch=7, row_bytes=6,
                                        rows=2, counter=counter, word=0, bias=2, dst_unit=6, limit=4)
        expected = np.zeros(40, np.uint8)  # counter word 0 is 0: index 2, bytes 12..18 and 19..25
        expected[12:18], expected[19:25] = src[1:7], src[8:14]
        np.testing.assert_array_equal(buffers.read(odd, np.uint8, 40), expected)
        with pytest.raises(InvalidArgumentError, match="exceeds|holds"):  # index limit - 1 would write past dst
            handle.hook.device_copy_rows_at(src=source, src_offset=0, src_pitch=row, dst=odd, dst_pitch=row,
                                            row_bytes=row, rows=1, counter=counter, word=0, bias=0, dst_unit=row,
                                            limit=3)
        with pytest.raises(InvalidArgumentError, match="overlaps"):
            handle.hook.device_copy_rows_at(src=target, src_offset=0, src_pitch=row, dst=target, dst_pitch=row,
                                            row_bytes=row, rows=1, counter=counter, word=0, bias=0, dst_unit=row,
                                            limit=2)
        with pytest.raises(InvalidArgumentError, match="word"):
            handle.hook.device_copy_rows_at(src=source, src_offset=0, src_pitch=row, dst=target, dst_pitch=row,
                                            row_bytes=row, rows=1, counter=counter, word=2, bias=0, dst_unit=row,
                                            limit=2)
    finally:
        buffers.close()


def test_the_contract_check_of_the_counter_copy_passes(handle):
    from onnx_runtime.testing.contract import check_for

    check_for("device_copy_rows_at")(handle, "device_copy_rows_at")


def test_cuda_implements_contract_1_3s_counter_hooks(cuda_handle):
    from onnx_runtime.contract import VERSION

    assert cuda_handle.contract_version == VERSION  # the provider follows the core's contract (1.3 or later)
    assert cuda_handle.implements("device_token_writer_at") and cuda_handle.implements("device_copy_rows_at")


def test_a_provider_without_the_hooks_refuses_device_buffers_by_name(cuda_handle):
    """The contract's defaults serve host memory only: a device buffer gets NotSupportedError naming the hook."""
    from onnx_runtime.contract.defaults import DefaultFallbacks
    from onnx_runtime.errors import NotSupportedError

    defaults = DefaultFallbacks(cuda_handle)
    buffer = cuda_handle.allocate(64, 256)
    try:
        with pytest.raises(NotSupportedError, match="device_copy_rows_at"):
            defaults.device_copy_rows_at(src=buffer, src_offset=0, src_pitch=8, dst=buffer, dst_pitch=8, row_bytes=8,
                                         rows=1, counter=buffer, word=0, bias=0, dst_unit=8, limit=1)
        with pytest.raises(NotSupportedError, match="device_token_writer_at"):
            defaults.device_token_writer_at(result=buffer, input_ids=buffer, position_ids=buffer,
                                            attention_mask=buffer, scratch=buffer, capacity=1, mask_len=0,
                                            write_position=False, counter=buffer)
    finally:
        cuda_handle.deallocate(buffer)


# -- the captured decode step of generate -------------------------------------------------------------------------
CUDA = "CUDAExecutionProvider"


def _capturing_session(path: str):
    import onnx_runtime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(path, options, providers=[CUDA, "CPUExecutionProvider"])


def _counted_steps(session, monkeypatch, counting) -> list[dict]:
    """The driver calls of each decode step: from one bound run's start to the next one's (the step's run, and
    whatever generate launches after it)."""
    steps: list[dict] = []
    started = []
    run = session.run_with_device_bindings

    def counted(*args, **kwargs):
        if started:
            steps.append(dict(counting.calls))
        started.append(True)
        counting.calls.clear()
        return run(*args, **kwargs)

    monkeypatch.setattr(session, "run_with_device_bindings", counted)
    return steps


@pytest.mark.parametrize("name", ["gpt2.torchscript.fp32", "llama.dynamo.fp32"])
def test_a_decode_step_is_one_graph_launch_with_its_argmax_and_token_writer(name, cuda_driver_mode, monkeypatch):
    """Issue 21: the KV row moves, the mask bit, argmax and the token writer are captured with the model's run
    (their step and position come from the device counter), so each replayed step is one graph launch and no
    host synchronization or transfer; before, 12 driver calls followed each replay (the bound outputs' 5 device
    copies, 4 pitched KV copies, the mask copy, argmax and the token writer), then 6 more: the validation word's
    clear and its copies to the 5 output bindings that receive it. The generation's validation prologue (carry
    and clear, validation.cu) is now recorded in the graph, so a replayed step is exactly one cuGraphLaunch.
    The tokens are the CPU provider's greedy tokens and onnxruntime's."""
    from onnx_runtime.generate import Generator

    path = _model(name)
    new = 12
    session = _capturing_session(path)
    device = session.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    steps = _counted_steps(session, monkeypatch, counting)
    gc.collect()  # an earlier test's tensors, collected mid-step, would free (cuMemFreeAsync) inside a step's count
    tokens = Generator(session).generate(PROMPT, new).tokens
    steps.append(dict(counting.calls))  # the last step, and the drain of the tokens
    cpu = Generator(path, providers=["CPUExecutionProvider"]).generate(PROMPT, new).tokens
    assert tokens == cpu == onnxruntime_greedy(path, PROMPT, new)
    runner = session._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    assert (runner.captures, runner.replays, runner.segment_captures) == (1, new - 2, 1)
    # (cuCtxSetCurrent only rebinds this thread's context: an earlier test's tensor collected meanwhile may have
    # bound its own device's)
    replayed = [{call: n for call, n in step.items() if call != "cuCtxSetCurrent"} for step in steps[3:-1]]
    assert replayed == [{"cuGraphLaunch": 1}] * (new - 4), steps
    assert counting.syncs() >= 1 and all("Synchronize" not in call for step in steps[3:-1] for call in step)


def test_tokens_read_every_k_steps_synchronize_only_there(cuda_driver_mode, monkeypatch):
    """``generate(on_token=..., read_every=K)`` reads the chosen tokens once per K steps: the replayed steps between
    two reads neither synchronize nor transfer, and the streamed tokens are the greedy ones, stopping at the
    end-of-sequence token even when it is read in the middle of a batch."""
    from onnx_runtime.generate import Generator

    path = _model("gpt2.torchscript.fp32")
    new, every = 13, 4
    expected = onnxruntime_greedy(path, PROMPT, new)
    session = _capturing_session(path)
    device = session.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    steps = _counted_steps(session, monkeypatch, counting)
    streamed: list[int] = []
    result = Generator(session).generate(PROMPT, new, on_token=streamed.append, read_every=every)
    steps.append(dict(counting.calls))
    assert result.tokens == streamed == expected
    reads = [index for index, step in enumerate(steps) if "cuMemcpyDtoHAsync" in step or any(
        "Synchronize" in call for call in step)]
    # Step 0 reads the first token (time to first token); step 1 is the eager warm-up run (it uploads what its
    # host shape computations give); the captured and replayed steps read at 3, 7, 11 (every 4th) and the last.
    assert reads[0] == 0 and [index for index in reads if index >= 2] == [3, 7, 11, 12], steps
    eos = expected[5]
    stop = Generator(session).generate(PROMPT, new, on_token=None, eos_token_id=eos, read_every=every)
    assert stop.tokens == expected[: expected.index(eos) + 1]
    with pytest.raises(InvalidArgumentError, match="read_every"):
        Generator(session).generate(PROMPT, 2, read_every=0)


def test_a_second_generation_captures_at_its_own_addresses(cuda_driver_mode):
    """The step's graph bakes the addresses of the generation's bindings (the counter, the token slots): their
    release at the end of a generation resets it, so the next generation on the session captures its own graph
    instead of replaying launches into freed memory; both generations give the greedy tokens, and every device
    allocation is freed once."""
    from onnx_runtime.generate import Generator

    path = _model("llama.torchscript.fp32")
    expected = onnxruntime_greedy(path, PROMPT, 7)
    session = _capturing_session(path)
    handle = session.provider_handle(CUDA)
    generator = Generator(session)
    runner = session._executor.graphs  # noqa: SLF001  (white box: the captured entries)
    assert generator.generate(PROMPT, 7).tokens == expected
    steps = [entry for entries in runner._entries.values() for entry in entries.values() if entry.tail]  # noqa: SLF001
    assert len(steps) == 1 and steps[0].token is not None
    assert not handle.hook.has_owned_device_graph(token=steps[0].token)  # reset when its bindings were released
    assert generator.generate(PROMPT[:3], 4).tokens == onnxruntime_greedy(
        path, PROMPT[:3], 4)
    assert generator.generate(PROMPT, 7).tokens == expected
    assert runner.captures >= 3 and runner.replays >= 5 + 2 + 5
    del generator, steps
    session.close()  # graphs, arenas, weights; the host shape kernels' device copies go with the session
    del session, runner
    gc.collect()
    allocations, frees = handle.allocation_counts()
    assert allocations == frees and allocations > 0


def test_two_threads_generate_on_two_sessions_at_once(cuda_driver_mode):
    """Two sessions on one device, each generating on its own thread at the same time: each captures its decode
    step once (epilogue included) and replays it, and each gets the greedy tokens. The device's capture gate keeps
    one thread's launches out of the other's graph (the sessions share the compute stream)."""
    import threading

    from onnx_runtime.generate import Generator

    names = ["gpt2.torchscript.fp32", "llama.torchscript.fp32"]
    new = 9
    expected = {name: onnxruntime_greedy(_model(name), PROMPT, new) for name in names}
    sessions = {name: _capturing_session(_model(name)) for name in names}
    barrier = threading.Barrier(len(names))
    got: dict[str, list] = {}
    failures: list[BaseException] = []

    def work(name: str) -> None:
        try:
            generator = Generator(sessions[name])
            barrier.wait()
            got[name] = [generator.generate(PROMPT, new).tokens for _round in range(2)]
        except BaseException as exc:  # reported below, with the thread's traceback
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for name in names:
        assert got[name] == [expected[name]] * 2, name
        runner = sessions[name]._executor.graphs  # noqa: SLF001
        assert runner.captures >= 2 and runner.replays >= 2 * (new - 3), (name, runner.counts)
