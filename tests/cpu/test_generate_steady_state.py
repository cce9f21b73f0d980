"""A generation loop builds nothing per step: the shape specializations, the kernels made per node and shape and
the symbolic shape programs a decode loop needs are made a fixed number of times (the prefill's and the decode
step's), however many tokens a generation makes, and a second generation through the same lengths or further
makes none. Over the zoo's decoders from both torch exporters."""

from __future__ import annotations

import collections

import pytest
from onnx_runtime.generate import Generator
from onnx_runtime.session import shape_program, specialize, steps
from test_generate import PROMPT, _model

CPU = "CPUExecutionProvider"


@pytest.fixture
def builds(monkeypatch) -> collections.Counter:
    """Counts of the specializer's builds, the kernels made and the shape programs built, while the test runs."""
    counts: collections.Counter = collections.Counter()

    def counted(owner, name: str):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    counted(specialize.Specializer, "_build")
    counted(steps, "make_kernel")
    counted(shape_program, "build")
    return counts


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.dynamo.fp32", "gpt2.torchscript.fp32",
                                  "llama.torchscript.fp32"])
def test_a_generation_builds_as_much_for_many_tokens_as_for_few_and_then_nothing(name, builds):
    path = _model(name)
    Generator(path, providers=[CPU]).generate(PROMPT, 8)
    few = dict(builds)
    builds.clear()
    generator = Generator(path, providers=[CPU])
    tokens = generator.generate(PROMPT, 40).tokens
    assert dict(builds) == few and few["_build"] == 2  # the prefill's specialization and the decode step's
    builds.clear()
    assert generator.generate(PROMPT, 40).tokens == tokens
    assert generator.generate(PROMPT, 60).tokens[:40] == tokens
    assert not builds  # the same lengths and longer ones: nothing made again
