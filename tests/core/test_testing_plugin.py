"""onnx_runtime.testing, the pytest plugin for provider authors: inert unless enabled, its fixtures, declined
backend cases as skips with the provider's reasons, contract checks that catch kernel mistakes, the summary."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

SESSION_TEST = '''
import numpy as np
from onnx import TensorProto, helper


def test_relu_on_the_provider(session_factory, assert_runs_on_provider, provider_name):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    session = session_factory(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    x = np.array([-1, 2, -3, 4], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0))
    assert_runs_on_provider(session)
    assert session.get_providers()[0] == provider_name
'''

# A provider whose Relu kernel writes into its input and returns float64 and an array instead of a tuple.
BROKEN_CONFTEST = '''
import numpy as np
import onnx_runtime
from onnx_runtime import KernelMatch, hookimpl


class CarelessExecutionProvider:
    @hookimpl
    def name(self):
        return "CarelessExecutionProvider"

    @hookimpl
    def supports_op(self, node):
        if node.op_type != "Relu":
            return KernelMatch.unsupported("CarelessExecutionProvider runs only Relu")
        return KernelMatch.supported()

    @hookimpl
    def get_kernel(self, node):
        def relu(x):
            np.maximum(x, 0, out=x)
            return x.astype(np.float64)
        return relu


onnx_runtime.register_provider(CarelessExecutionProvider)
'''


def _summary(result) -> str:
    (line,) = [line for line in result.outlines if line.startswith("onnx_runtime.testing: ")]
    return line


def test_a_run_that_does_not_enable_the_plugin_has_none_of_it(pytester):
    pytester.makepyfile(test_plain=SESSION_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'session_factory' not found*"])
    assert not any(line.startswith("onnx_runtime.testing: ") for line in result.outlines)


@pytest.mark.parametrize("enable", [["-p", "onnx_runtime.testing", "--provider", "cpu"], ["--provider", "cpu"]])
def test_the_fixtures_build_sessions_on_the_named_provider(pytester, enable):
    pytester.makepyfile(test_session=SESSION_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *enable)
    result.assert_outcomes(passed=1)
    assert _summary(result) == "onnx_runtime.testing: CPUExecutionProvider: no backend cases or contract checks ran"


def test_the_ini_option_enables_it(pytester):
    pytester.makeini("[pytest]\nonnx_runtime_testing = true\nonnx_runtime_provider = SampleDeviceExecutionProvider\n")
    pytester.makepyfile(test_session=SESSION_TEST)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_declined_backend_cases_are_skips_with_the_providers_reason_and_the_summary_counts_them(pytester):
    pytester.makepyfile(test_backend="from onnx_runtime.testing.backend import *  # noqa: F403\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--provider", "SampleDeviceExecutionProvider",
                                           "-rs", "-k", "test_relu or test_sigmoid or test_add_bcast or contract")
    result.stdout.fnmatch_lines(["*declined by SampleDeviceExecutionProvider: *Sigmoid*runs only*"])
    summary = _summary(result)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|declined|failed)", summary.split(";")[0])}
    assert counts["passed"] >= 2 and counts["declined"] >= 1 and counts["failed"] == 0, summary
    assert "contract checks" in summary and result.ret == 0


def test_the_contract_checks_name_each_kernel_mistake(pytester):
    pytester.makeconftest(BROKEN_CONFTEST)
    pytester.makepyfile(test_backend="from onnx_runtime.testing.backend import *  # noqa: F403\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--provider", "careless", "-k", "contract")
    result.assert_outcomes(failed=1, passed=2)
    result.stdout.fnmatch_lines(["*the Relu kernel returned ndarray, not a tuple of 1 output*"])
    assert "contract checks 2 passed, 0 declined, 1 failed" in _summary(result)


def test_an_unknown_provider_is_a_usage_error_naming_the_installed_ones(pytester):
    pytester.makepyfile(test_session=SESSION_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--provider", "nosuch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*'nosuch' is not installed (installed: *CPUExecutionProvider*"])


def test_the_guides_example_test_runs_on_the_guides_provider(pytester):
    """docs/writing-a-provider.md: its provider (section 1) and plugin module (section 2) installed in place, and
    its example test (the block marked <!-- pytest -->) run with the plugin as the guide says."""
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "writing-a-provider.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^(<!-- (?:runnable|pytest) -->)\n```python\n(.*?)^```$", guide, re.M | re.S)
    files = {code.splitlines()[0].lstrip("# ").strip(): code for marker, code in blocks
             if code.startswith(("# my_onnx_ep/provider.py", "# my_onnx_ep/plugin.py")) or marker == "<!-- pytest -->"}
    assert sorted(files) == ["my_onnx_ep/plugin.py", "my_onnx_ep/provider.py", "tests/test_my_provider.py"]
    for path, code in files.items():
        (pytester.path / path).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / path).write_text(code)
    (pytester.path / "my_onnx_ep" / "__init__.py").write_text("")
    pytester.makeconftest("import onnx_runtime\nfrom my_onnx_ep import plugin\n\n"
                          "onnx_runtime.register_provider(plugin)\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "onnx_runtime.testing", "--provider", "my",
                                           "tests/test_my_provider.py")
    result.assert_outcomes(passed=1)


def _relu_provider(kernel_body):
    import onnx_runtime
    from onnx_runtime import KernelMatch, hookimpl

    class OneMistakeExecutionProvider:
        @hookimpl
        def name(self):
            return "OneMistakeExecutionProvider"

        @hookimpl
        def supports_op(self, node):
            if node.op_type != "Relu":
                return KernelMatch.unsupported("OneMistakeExecutionProvider runs only Relu")
            return KernelMatch.supported()

        @hookimpl
        def get_kernel(self, node):
            return kernel_body

    return onnx_runtime.ProviderHandle(OneMistakeExecutionProvider())


def _mutating(x):
    import numpy as np

    np.maximum(x, 0, out=x)
    return (x,)


KERNEL_MISTAKES = {
    "an array, not a tuple": (lambda x: x.clip(0), "returned ndarray, not a tuple of 1 output"),
    "float64 for float32": (lambda x: (x.clip(0).astype("float64"),), r"returned float64\[3, 4\], expected float32"),
    "a wrong shape": (lambda x: (x.clip(0).reshape(-1),), r"returned float32\[12\], expected float32\[3, 4\]"),
    "wrong values": (lambda x: (x,), "Relu kernel output"),
    "writes into its input": (_mutating, "wrote into its input"),
    "an untyped error": (lambda x: {}["boom"], "raised KeyError: 'boom'; the contract asks for a typed error"),
}


@pytest.mark.parametrize("mistake", sorted(KERNEL_MISTAKES))
def test_the_kernel_check_names_each_mistake(mistake):
    from onnx_runtime.testing import contract

    kernel, message = KERNEL_MISTAKES[mistake]
    handle = _relu_provider(kernel)
    handle.initialize({})
    with pytest.raises(AssertionError, match=message):
        contract.check_get_kernel(handle, "get_kernel")


def test_a_correct_kernel_passes_the_kernel_check():
    import numpy as np
    from onnx_runtime.testing import contract

    handle = _relu_provider(lambda x: (np.maximum(x, np.float32(0)),))
    handle.initialize({})
    contract.check_get_kernel(handle, "get_kernel")


def test_nodes_placed_elsewhere_that_the_provider_never_declined_are_a_silent_fallback():
    """The checker itself: the provider under test listed second is never asked, so its nodes go elsewhere
    without a reason; listed first, it declines Softmax with a reason (Declined, not a failure)."""
    import onnx_runtime
    from onnx import TensorProto, helper
    from onnx_runtime.testing.cases import Declined, SilentFallback, check_placement

    sample = "SampleDeviceExecutionProvider"
    if sample not in onnx_runtime.get_available_providers():
        pytest.skip("tests/sample_provider is not installed")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Softmax", ["r"], ["y"], name="sm")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
    behind = onnx_runtime.InferenceSession(model, providers=["CPUExecutionProvider", sample])
    with pytest.raises(SilentFallback, match=r"relu \(Relu\) on CPUExecutionProvider"):
        check_placement(behind, sample)
    first = onnx_runtime.InferenceSession(model, providers=[sample, "CPUExecutionProvider"])
    with pytest.raises(Declined, match=r"declined by SampleDeviceExecutionProvider: sm \(Softmax\): .*runs only"):
        check_placement(first, sample)


def test_sessions_from_the_fixtures_check_every_kernel_call(pytester):
    """Strict kernels are on in the plugin: the careless Relu (an array for a tuple) fails in a session too."""
    pytester.makeconftest(BROKEN_CONFTEST)
    pytester.makepyfile(test_session=SESSION_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--provider", "careless")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*KernelContractError*CarelessExecutionProvider*relu*"])
