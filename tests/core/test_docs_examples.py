"""The runnable examples of docs/writing-a-provider.md, executed as written.

A fenced ``python`` block immediately preceded by ``<!-- runnable -->`` is executed, in document order, in one
shared namespace. A runnable block whose first line is a file comment (``# my_onnx_ep/provider.py``) is also
installed as that module in ``sys.modules``, so later blocks import it exactly as a user's code would. A ``text``
block preceded by ``<!-- output -->`` is what the runnable block before it must print.

The providers the guide registers are unregistered afterwards, so other tests see the registry unchanged.
"""

from __future__ import annotations

import contextlib
import gc
import io
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_runtime
import pytest
from onnx import TensorProto, helper
from onnx_runtime.errors import UnsupportedOperatorError

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "writing-a-provider.md"
FENCE = re.compile(r"^(?:<!-- (?P<marker>runnable|output) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)
FILE_COMMENT = re.compile(r"#\s*(?P<path>[\w/]+)\.py\s*$")
MY = "MyExecutionProvider"
TOY = "ToyDeviceExecutionProvider"
CPU = "CPUExecutionProvider"


@dataclass
class Block:
    lang: str
    code: str
    marker: str | None
    expected_output: str | None = None
    printed: str | None = None

    @property
    def module(self) -> str | None:
        match = FILE_COMMENT.fullmatch(self.code.splitlines()[0]) if self.code else None
        return match["path"].replace("/", ".") if match else None


def guide_blocks() -> list[Block]:
    blocks: list[Block] = []
    for match in FENCE.finditer(GUIDE.read_text(encoding="utf-8")):
        block = Block(match["lang"], match["code"], match["marker"])
        if block.marker == "output":
            assert blocks and blocks[-1].marker == "runnable", "an <!-- output --> block must follow a runnable one"
            blocks[-1].expected_output = block.code
        blocks.append(block)
    return blocks


def _install_module(dotted: str) -> types.ModuleType:
    parts = dotted.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = []  # a package, so its submodules can be imported
            sys.modules[package] = module
    module = types.ModuleType(dotted)
    module.__file__ = f"{GUIDE.name}:{dotted}"
    sys.modules[dotted] = module
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)
    return module


@pytest.fixture(scope="module")
def guide():
    """Run the guide's runnable blocks; yield (namespace, blocks); undo every registration afterwards."""
    if CPU not in onnx_runtime.get_all_providers():
        pytest.skip("the guide's examples fall back to CPUExecutionProvider; install onnx-runtime[cpu]")
    before = set(onnx_runtime.get_all_providers())
    modules_before = set(sys.modules)
    namespace: dict = {"__name__": "writing_a_provider"}
    blocks = guide_blocks()
    try:
        for index, block in enumerate(blocks):
            if block.marker != "runnable":
                continue
            assert block.lang == "python", f"runnable block {index} is {block.lang!r}, not python"
            target = namespace
            if block.module:
                target = vars(_install_module(block.module))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block.code, f"{GUIDE.name}[block {index}]", "exec"), target)
            block.printed = out.getvalue()
            if target is not namespace:
                namespace.update({k: v for k, v in target.items() if not k.startswith("__")})
        yield namespace, blocks
    finally:
        for value in namespace.values():
            if isinstance(value, onnx_runtime.InferenceSession):
                value.close()
        added = set(onnx_runtime.get_all_providers()) - before
        for name in added:
            onnx_runtime.unregister_provider(name)
        for name in set(sys.modules) - modules_before:
            if name.split(".")[0] == "my_onnx_ep":
                del sys.modules[name]
        gc.collect()
        assert set(onnx_runtime.get_all_providers()) == before


def _model(nodes, inputs, outputs, opset=18):
    graph = helper.make_graph(nodes, "docs_check", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def _value(name, elem=TensorProto.FLOAT, shape=("N", 4)):
    return helper.make_tensor_value_info(name, elem, list(shape))


def test_the_guide_has_the_runnable_examples_it_promises(guide):
    _, blocks = guide
    runnable = [b for b in blocks if b.marker == "runnable"]
    assert [b.module for b in runnable if b.module] == ["my_onnx_ep.provider", "my_onnx_ep.plugin", "my_onnx_ep.device"]
    assert MY in onnx_runtime.get_all_providers() and TOY in onnx_runtime.get_all_providers()


def test_runnable_blocks_print_what_the_guide_shows(guide):
    _, blocks = guide
    checked = [b for b in blocks if b.expected_output is not None]
    assert len(checked) == 2
    for block in checked:
        assert block.printed == block.expected_output


def test_the_host_provider_runs_relu_and_add_in_a_real_session(guide):
    # z = Relu(x + y) - y with a dynamic batch: kernels are created per input shape.
    model = _model(
        [
            helper.make_node("Add", ["x", "y"], ["s"], name="add"),
            helper.make_node("Relu", ["s"], ["r"], name="relu"),
            helper.make_node("Sub", ["r", "y"], ["z"], name="sub"),
        ],
        [_value("x"), _value("y")],
        [_value("z")],
    )
    session = onnx_runtime.InferenceSession(model, providers=[MY, CPU])
    rng = np.random.default_rng(0)
    for batch in (1, 3, 3, 5):
        x, y = (rng.standard_normal((batch, 4)).astype(np.float32) for _ in range(2))
        (z,) = session.run(None, {"x": x, "y": y})
        assert z.dtype == np.float32 and z.shape == (batch, 4)
        np.testing.assert_allclose(z, np.maximum(x + y, 0) - y, rtol=1e-6)
    placement = session.placement()
    assert placement.as_dict() == {"add": MY, "relu": MY, "sub": CPU}
    assert placement["add"].rejected == {} and placement["relu"].rejected == {}
    assert "runs only ['Add', 'Relu']" in placement["sub"].rejected[MY]
    assert placement.copies == []  # both providers work in host memory
    assert session.get_providers() == [MY, CPU]


def test_the_host_provider_declines_other_dtypes_with_its_reason(guide):
    model = _model(
        [helper.make_node("Add", ["x", "y"], ["z"], name="add")],
        [_value("x", TensorProto.INT32), _value("y", TensorProto.INT32)],
        [_value("z", TensorProto.INT32)],
    )
    session = onnx_runtime.InferenceSession(model, providers=[MY, CPU])
    assert session.placement()["add"].rejected == {
        MY: "MyExecutionProvider runs float32 only; cast the inputs to float32"
    }
    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x, "y": x})[0], x + x)
    with pytest.raises(UnsupportedOperatorError, match="runs float32 only"):
        onnx_runtime.InferenceSession(model, providers=[MY])


def test_the_plugin_module_contributes_the_provider_as_the_entry_point_would(guide):
    plugin = sys.modules["my_onnx_ep.plugin"]
    onnx_runtime.unregister_provider(MY)
    assert MY not in onnx_runtime.get_all_providers()
    assert onnx_runtime.register_provider(plugin) == [MY]
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [_value("x")], [_value("y")])
    session = onnx_runtime.InferenceSession(model, providers=["my"])  # the default short name
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))
    assert session.placement().summary() == {MY: 1}


def test_the_pyproject_entry_point_names_the_plugin_module(guide):
    tomllib = pytest.importorskip("tomllib")
    _, blocks = guide
    (pyproject,) = [b for b in blocks if b.lang == "toml"]
    entry_points = tomllib.loads(pyproject.code)["project"]["entry-points"]["onnx_runtime.providers"]
    assert list(entry_points.values()) == ["my_onnx_ep.plugin"]
    provider_class = sys.modules["my_onnx_ep.provider"].MyExecutionProvider
    assert sys.modules["my_onnx_ep.plugin"].onnx_runtime_providers() == [provider_class]


def test_the_device_provider_copies_at_boundaries_and_frees_every_buffer_once(guide):
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Mul", ["r", "x"], ["m"], name="mul"),
            helper.make_node("Relu", ["m"], ["z"], name="relu2"),
        ],
        [_value("x")],
        [_value("z")],
    )
    session = onnx_runtime.InferenceSession(model, providers=[TOY, MY, CPU])
    assert session.placement().as_dict() == {"relu": TOY, "mul": CPU, "relu2": TOY}
    rng = np.random.default_rng(1)
    for batch in (2, 3):
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        (z,) = session.run(None, {"x": x})
        np.testing.assert_allclose(z, np.maximum(np.maximum(x, 0) * x, 0), rtol=1e-6)
    copies = {(c.value, c.source, c.target) for c in session.placement().copies}
    assert copies == {("x", "host", TOY), ("r", TOY, "host"), ("m", "host", TOY), ("z", TOY, "host")}
    device = session.provider_handle(TOY)
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations >= 2 * 4 and allocations == frees  # nothing stays resident between runs
    session.close()
    assert device.provider.memory == {}
