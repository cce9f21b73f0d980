"""benchmarks/generate_bench.py's genai_config.json: attention heads, key/value heads and the hidden size read from
the export (the script once wrote 4 heads whatever the model had: right for the zoo's 4 heads of 16 only), for
plain and grouped-query caches, a tied or untied output projection, and a typed error where nothing says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import generate_bench  # noqa: E402

VOCAB = 50


def decoder_signature(tmp_path, hidden: int, heads: int, kv_heads: int, layers: int = 2, tied: bool = True,
                      embedding: bool = True) -> str:
    """A model with a decoder-with-past's inputs and outputs and its embedding and output tables (the config reads
    nothing else): logits = Gather(table, input_ids) @ table^T (tied) or @ a (hidden, vocabulary) head."""
    head = hidden // heads
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB])]
    nodes, weights = [], []
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, hidden)).astype(np.float32)
    if embedding:
        weights.append(numpy_helper.from_array(table, "embed.weight"))
        nodes.append(helper.make_node("Gather", ["embed.weight", "input_ids"], ["x"]))
    else:  # the tokens as floats, one column each: no embedding table
        nodes += [helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
                  helper.make_node("Unsqueeze", ["ids", "axis"], ["x1"]),
                  helper.make_node("Expand", ["x1", "width"], ["x"])]
        weights += [numpy_helper.from_array(np.array([2], np.int64), "axis"),
                    numpy_helper.from_array(np.array([1, 1, hidden], np.int64), "width")]
    if tied:
        nodes += [helper.make_node("Transpose", ["embed.weight" if embedding else "head.t"], ["head"], perm=[1, 0])]
        if not embedding:
            weights.append(numpy_helper.from_array(table, "head.t"))
    else:
        weights.append(numpy_helper.from_array(table.T.copy(), "head"))
    nodes.append(helper.make_node("MatMul", ["x", "head"], ["logits"]))
    for layer in range(layers):
        for kind in ("key", "value"):
            past, present = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
            inputs.append(helper.make_tensor_value_info(past, TensorProto.FLOAT, ["batch", kv_heads, "past", head]))
            outputs.append(helper.make_tensor_value_info(present, TensorProto.FLOAT,
                                                         ["batch", kv_heads, "total", head]))
            nodes.append(helper.make_node("Identity", [past], [present]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, weights)
    path = tmp_path / "decoder.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def config(path: str) -> dict:
    folder = generate_bench.genai_folder(path, 1, 64)
    return json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]


@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "tied"),
                         [(96, 6, 6, True), (96, 6, 2, False), (128, 8, 8, False), (64, 4, 2, True)])
def test_heads_and_hidden_size_are_the_models(tmp_path, hidden, heads, kv_heads, tied):
    decoder = config(decoder_signature(tmp_path, hidden, heads, kv_heads, tied=tied))
    assert decoder["num_attention_heads"] == heads
    assert decoder["num_key_value_heads"] == kv_heads
    assert decoder["head_size"] == hidden // heads
    assert decoder["hidden_size"] == hidden
    assert decoder["num_hidden_layers"] == 2


def test_an_output_projection_alone_gives_the_hidden_size(tmp_path):
    decoder = config(decoder_signature(tmp_path, 96, 6, 3, tied=False, embedding=False))
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["hidden_size"]) == (6, 3, 96)


def test_a_model_without_a_vocabulary_table_is_a_typed_error(tmp_path):
    path = decoder_signature(tmp_path, 96, 6, 6, tied=True, embedding=False)
    model = onnx.load(path)
    for table in model.graph.initializer:
        if table.name == "head.t":  # the same values made at run time: no (vocabulary, hidden) constant left
            table.CopyFrom(numpy_helper.from_array(np.zeros((VOCAB * 96,), np.float32), "head.t"))
    onnx.save(model, path)
    with pytest.raises(ValueError, match="hidden size"):
        config(path)
