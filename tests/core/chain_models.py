"""The memory tests' model: a chain of Add/Mul by one [1, width] weight per layer, then Relu, saved with every
weight in external data (so the loader can map it and the sample device can page it)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def external_chain(path, width: int, layers: int = 8, seed: int = 0, location: str | None = None) -> str:
    """Write the chain to ``path`` (weights in ``location``, default ``<name>.data`` beside it); returns the path."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "X"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((1, width)).astype(np.float32), f"W{i}"))
        nodes.append(helper.make_node("Add" if i % 2 == 0 else "Mul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    nodes.append(helper.make_node("Relu", [prev], ["Y"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location=location or path.name + ".data",
                    size_threshold=0)
    return str(path)
