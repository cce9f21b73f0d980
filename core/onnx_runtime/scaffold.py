"""``onnx-runtime new-provider NAME``: a provider distribution to start from.

It writes a distribution whose provider runs Relu and Add on float32 with numpy (real kernels, declining the rest
with reasons), registered through the ``onnx_runtime.providers`` entry point, with tests that use the
``onnx_runtime.testing`` plugin (its fixtures, the onnx backend suite and the contract checks) and a tox.ini that
runs them. The tests pass as generated, installed or run in place from the folder.
"""

from __future__ import annotations

import os
import re

from .errors import InvalidArgumentError


def names(name: str) -> dict[str, str]:
    """The spellings of a provider name: ``my-accel`` -> distribution ``onnx-runtime-ep-my-accel``, package
    ``onnx_runtime_ep_my_accel``, class ``MyAccelExecutionProvider``, short name ``myaccel``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    slug = slug.removesuffix("-execution-provider").removesuffix("executionprovider").strip("-")
    if not slug or not slug[0].isalpha():
        raise InvalidArgumentError(f"new-provider: {name!r} is not a usable provider name; start it with a letter, "
                                   "e.g. 'my-accel'")
    words = slug.split("-")
    return {
        "slug": slug,
        "dist": f"onnx-runtime-ep-{slug}",
        "package": "onnx_runtime_ep_" + "_".join(words),
        "cls": "".join(w.capitalize() for w in words) + "ExecutionProvider",
        "short": "".join(words),
    }


PYPROJECT = '''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{cls} for onnx-runtime"
requires-python = ">=3.10"
dependencies = ["onnx-runtime", "numpy>=1.24"]

[project.optional-dependencies]
test = ["pytest>=8", "onnx-runtime[cpu]"]

[project.entry-points."onnx_runtime.providers"]
{short} = "{package}.plugin"

[tool.setuptools.packages.find]
include = ["{package}*"]

[tool.pytest.ini_options]
testpaths = ["tests"]
pythonpath = ["."]
# onnx_runtime.testing: fixtures for this provider, the onnx backend suite and the contract checks.
onnx_runtime_testing = true
onnx_runtime_provider = "{cls}"
'''

PROVIDER = '''"""{cls}: Relu and Add on float32, with numpy. Add operators to KERNELS."""

import numpy as np

from onnx_runtime import DataType, KernelMatch, hookimpl


def relu_kernel(node, shapes):
    zero = np.float32(0)
    return lambda x: (np.maximum(x, zero),)


def add_kernel(node, shapes):
    return lambda a, b: (np.add(a, b),)


KERNELS = {{"Relu": relu_kernel, "Add": add_kernel}}
FIRST_OPSET = {{"Relu": 6, "Add": 7}}  # the opsets from which these kernels implement the operator


class {cls}:
    @hookimpl
    def name(self):
        return "{cls}"

    @hookimpl
    def short_name(self):
        return "{short}"

    @hookimpl
    def supports_op(self, node, opset, dtypes):
        if node.domain or node.op_type not in KERNELS:
            return KernelMatch.unsupported(f"{cls} runs only {{sorted(KERNELS)}}; list another provider after it")
        if opset < FIRST_OPSET[node.op_type]:
            return KernelMatch.unsupported(
                f"{cls} implements {{node.op_type}} from opset {{FIRST_OPSET[node.op_type]}}; re-export the model"
            )
        if any(dtype is not DataType.FLOAT for dtype in dtypes):
            return KernelMatch.unsupported("{cls} runs float32 only; cast the inputs to float32")
        return KernelMatch.supported(cost=1.0)

    @hookimpl
    def get_kernel(self, node, shapes):
        return KERNELS[node.op_type](node, shapes)
'''

PLUGIN = '''from onnx_runtime import hookimpl

from {package}.provider import {cls}


@hookimpl
def onnx_runtime_providers():
    return [{cls}]
'''

CONFTEST = '''"""Run in place (the distribution not installed): register the provider in this process, as its entry
point would."""

import onnx_runtime
from onnx_runtime.discovery import registry

if registry().find("{cls}") is None:
    from {package} import plugin

    onnx_runtime.register_provider(plugin)
'''

TEST_PROVIDER = '''"""{cls} in sessions, through onnx_runtime.testing's fixtures."""

import numpy as np
from onnx import TensorProto, helper


def relu_add_model():
    """y = Relu(x + b): both nodes run on {cls}."""
    b = helper.make_tensor("b", TensorProto.FLOAT, [1, 3], [-1.0, 0.0, 1.0])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["s"], name="add"), helper.make_node("Relu", ["s"], ["y"], name="relu")],
        "relu_add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_relu_add_matches_the_reference(session_factory, assert_runs_on_provider):
    model = relu_add_model()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    session = session_factory(model)
    (got,) = session.run(None, {{"x": x}})
    want = np.maximum(x.astype(np.float64) + [[-1.0, 0.0, 1.0]], 0)  # the float64 reference
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_runs_on_provider(session)  # no node fell back to another provider


def test_other_operators_are_declined_with_a_reason(session_factory, provider_name):
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["y"], name="sigmoid")],
        "sigmoid",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = session_factory(model, fallback=True)
    assert "runs only" in session.placement()["sigmoid"].rejected[provider_name]
'''

TEST_BACKEND = '''"""The onnx backend node cases and model sets on {cls} (declined cases are skips with its
reasons), and the contract checks of every hook it implements: onnx_runtime.testing parametrizes these tests."""

from onnx_runtime.testing.backend import *  # noqa: F403
'''

TOX = '''# onnx-runtime is not on PyPI: point ONNX_RUNTIME_SRC at a checkout of it.
[tox]
envlist = py, backend

[testenv]
deps =
    pytest>=8
    -e {{env:ONNX_RUNTIME_SRC}}[cpu]
    -e {{env:ONNX_RUNTIME_SRC}}/providers/cpu
commands = pytest tests/test_provider.py {{posargs}}

[testenv:backend]
description = the whole onnx backend suite and the contract checks on {cls}
commands = pytest -p onnx_runtime.testing --provider {cls} tests/test_backend.py {{posargs}}
'''

README = '''# {dist}

`{cls}` for [onnx-runtime](https://github.com/): Relu and Add on float32 with numpy.

    pip install -e .                 # registers the provider through the onnx_runtime.providers entry point
    pytest                           # its tests, the onnx backend suite and the contract checks
    tox -e backend                   # the same in a fresh environment (set ONNX_RUNTIME_SRC)

`pytest` prints a summary line of what the provider supports: backend cases passed, declined (with the
provider's reasons) and failed.
'''


def generate(name: str, directory: str = ".") -> str:
    """Write the distribution for provider ``name`` under ``directory``; return its folder."""
    spelled = names(name)
    root = os.path.join(directory, spelled["dist"])
    if os.path.exists(root):
        raise InvalidArgumentError(f"new-provider: {root!r} already exists; remove it or choose another --dir")
    files = {
        "pyproject.toml": PYPROJECT,
        "tox.ini": TOX,
        "README.md": README,
        f"{spelled['package']}/__init__.py": '"""{cls} for onnx-runtime."""\n',
        f"{spelled['package']}/provider.py": PROVIDER,
        f"{spelled['package']}/plugin.py": PLUGIN,
        "tests/conftest.py": CONFTEST,
        "tests/test_provider.py": TEST_PROVIDER,
        "tests/test_backend.py": TEST_BACKEND,
    }
    for path, template in files.items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(template.format(**spelled))
    return root


def cmd_new_provider(args) -> int:
    root = generate(args.name, args.dir)
    print(f"wrote {root}: pip install -e {root} && cd {root} && pytest")
    return 0
