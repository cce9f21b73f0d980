"""The host generate loop's per-step glue (issue 21): a prepared run looks at its bindings' release only after some
binding was released (a process-wide count, not every binding at every step), and the loop grows the mask by one row
within its capacity without the logical-shape check. Tokens stay onnxruntime's greedy tokens on both exporters."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import logical_shape_checks
from onnx_runtime import generate
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session.device_io_binding import DeviceBindingSpec, DeviceIoBinding
from test_generate import PROMPT, _model, onnxruntime_greedy
from test_generate_held_scopes import _window_run

CPU = "CPUExecutionProvider"


def _count_closed_looks(monkeypatch) -> list:
    looks: list = []
    closed = DeviceIoBinding.closed

    def counting(self):
        looks.append(self.label)
        return closed.fget(self)

    monkeypatch.setattr(DeviceIoBinding, "closed", property(counting))
    return looks


def test_a_prepared_run_looks_at_its_bindings_only_after_a_release(monkeypatch):
    session, past, new, run = _window_run()
    run(False)
    looks = _count_closed_looks(monkeypatch)
    with run.held() as step:
        for _ in range(3):
            step(False)
    assert looks == []  # nothing released: no binding looked at
    other = session.device_io_binding(DeviceBindingSpec.scratch("other", np.float32, (4,)))
    other.close()  # a release elsewhere: one look at the run's two bindings, then none again
    run(False)
    run(False)
    assert len(looks) == 2
    new.close()
    with pytest.raises(InvalidArgumentError, match="released"):
        run(False)
    with pytest.raises(InvalidArgumentError, match="released"):  # and at every run after it
        run(False)


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "gpt2.torchscript.fp32", "llama.dynamo.fp32",
                                  "llama.torchscript.fp32"])
def test_host_steps_grow_the_mask_unchecked_and_keep_the_greedy_tokens(monkeypatch, name):
    path = _model(name)
    generator = generate.Generator(path, providers=[CPU])
    generator.generate(PROMPT, 7)  # (the state both generations below reuse)
    checked = logical_shape_checks(monkeypatch)
    looks = _count_closed_looks(monkeypatch)
    checks = []
    for new in (3, 7):
        checked.clear()
        assert generator.generate(PROMPT, new).tokens == onnxruntime_greedy(path, PROMPT, new)
        checks.append(sorted(checked))
    # Only a generation's start (the caches emptied, the prompt written) and its first step (the ids and positions
    # made one token) check a shape: as many for 7 steps as for 3 (the mask grew inside its capacity at each step).
    assert checks[0] == checks[1], checks
    assert looks == []
    state = generator._kept  # noqa: SLF001 (the generation's kept state)
    assert state.mask.logical_shape == (1, len(PROMPT) + new)
    assert {cache.logical_shape[2] for cache in state.caches} == {len(PROMPT) + new - 1}
    mask = state.host[3]
    assert mask[: len(PROMPT) + new - 1].all()


def test_a_generation_stopping_at_its_end_token_keeps_the_mask_of_the_steps_it_ran():
    path = _model("gpt2.dynamo.fp32")
    generator = generate.Generator(path, providers=[CPU])
    greedy = onnxruntime_greedy(path, PROMPT, 6)
    result = generator.generate(PROMPT, 6, eos_token_id=greedy[2])
    assert result.tokens == greedy[: greedy.index(greedy[2]) + 1]
    state = generator._kept  # noqa: SLF001
    ran = len(result.tokens)
    # The step that chose the end token ran with ran - 1 new rows before it; the loop stopped before growing the mask.
    assert state.mask.logical_shape == (1, len(PROMPT) + ran - 1)


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_host_steps_feed_by_the_layouts_flags_and_adopt_appended_presents(monkeypatch, name):
    """A host step reads each input's shape through the flags its layout read once (no kernel_input_shape call per
    binding) and, its outputs all appended in place, only adopts their shapes (never _host_outputs' copying way),
    with the caches' logical shapes and onnxruntime's greedy tokens after it."""
    from onnx_runtime.session import device_binding_run

    path = _model(name)
    generator = generate.Generator(path, providers=[CPU])
    generator.generate(PROMPT, 3)
    asked, general = [], []
    shape_of, outputs = DeviceIoBinding.kernel_input_shape, device_binding_run._host_outputs  # noqa: SLF001
    monkeypatch.setattr(DeviceIoBinding, "kernel_input_shape", lambda self, *a: asked.append(self.label) or
                        shape_of(self, *a))
    monkeypatch.setattr(device_binding_run, "_host_outputs", lambda *a: general.append(1) or outputs(*a))
    new = 6
    assert generator.generate(PROMPT, new).tokens == onnxruntime_greedy(path, PROMPT, new)
    assert asked == [] and general == []
    state = generator._kept  # noqa: SLF001
    assert {cache.logical_shape[2] for cache in state.caches} == {len(PROMPT) + new - 1}


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_a_later_generation_feeds_the_views_kept_per_shape_and_checks_nothing(monkeypatch, name):
    """Each input's view is kept per shape (the mask's per length) and a cache's longer window, once its length was
    seen to vary, is kept as the next step's view without the proof's test: a later generation on the same state
    tests no shape at all, and another prompt of that length, written into the same buffers, gives its own tokens."""
    from onnx_runtime.session import device_binding_run

    path = _model(name)
    generator = generate.Generator(path, providers=[CPU])
    generator.generate(PROMPT, 6)
    tests: list = []
    admits = device_binding_run._InputProof.admits  # noqa: SLF001
    monkeypatch.setattr(device_binding_run._InputProof, "admits",  # noqa: SLF001
                        lambda self, shape: tests.append(shape) or admits(self, shape))
    fed: list = []
    host_feeds = device_binding_run._host_feeds  # noqa: SLF001
    monkeypatch.setattr(device_binding_run, "_host_feeds", lambda *a: fed.append(1) or host_feeds(*a))
    other = [t + 7 for t in PROMPT]
    for prompt, new in ((PROMPT, 6), (other, 6), (PROMPT, 4)):
        assert generator.generate(prompt, new).tokens == onnxruntime_greedy(path, prompt, new)
    assert tests == []
    assert fed == []  # every step's shapes were fed before: their feeds and executor found at once


def test_a_prepared_run_feeds_a_kept_view_with_the_buffers_contents_now():
    """The views and executor kept for a set of shapes read what the buffers hold at that run: lengths alternating
    (and a new one) with new contents written each time, a new physical shape, and single-token steps that show a
    freeze-safe mask at its capacity give the model's output of each; a shape the model refuses is refused at every
    run, also after the others were kept."""
    from model_helpers import make_model, tensor_info
    from onnx import helper
    from onnx_runtime import InferenceSession

    model = make_model([helper.make_node("Neg", ["x"], ["y"]), helper.make_node("Neg", ["m"], ["z"])],
                       [tensor_info("x", shape=[1, "n"]), tensor_info("m", shape=[1, "k"])],
                       [tensor_info("y", shape=[1, "n"]), tensor_info("z", shape=[1, "k"])]).SerializeToString()
    session = InferenceSession(model, providers=[CPU])
    x = session.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 8), (1, 3),
                                                          expose_logical_input_shape=True))
    m = session.device_io_binding(DeviceBindingSpec.input(
        "m", np.float32, (1, 6), (1, 2), expose_logical_input_shape=True, decode_freeze_safe_mask=True))
    run = session.prepare_device_binding_run([x, m], output_names=["y", "z"])
    rng = np.random.default_rng(0)
    for count, (length, single) in enumerate(((3, False), (5, True), (3, False), (5, True), (4, False), (3, True),
                                              (5, False), (3, True))):
        if count == 5:
            x.set_physical_and_logical_shapes((1, 6), (1, length))
        value = rng.standard_normal((1, length)).astype(np.float32)
        x.write_logical(value)
        mask = rng.standard_normal((1, 6)).astype(np.float32)
        m.write_logical(mask)
        m.set_logical_shape((1, 2))
        y, z = run(single)
        np.testing.assert_array_equal(y, -value)
        np.testing.assert_array_equal(z, -(mask if single else mask[:, :2]))  # capacity on a single-token step
    x.set_physical_and_logical_shapes((2, 8), (2, 3))
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="'x'"):
            run(False)
    x.set_logical_shape((1, 3))
    x.write_logical(value[:, :3])
    np.testing.assert_array_equal(run(False)[0], -value[:, :3])
