"""Invalid attributes raise a typed error naming the node and the attribute, across families."""

from __future__ import annotations

import pytest
from kernel_reference import f32, i32, i64, make_kernel
from onnx import TensorProto
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- invalid attributes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, inputs, attrs, opset, attribute",
    [
        ("Mod", [i32(2), i32(2)], {"fmod": 2}, 13, "fmod"),
        ("DepthToSpace", [f32(1, 4, 1, 1)], {"blocksize": 2, "mode": "XYZ"}, 13, "mode"),
        ("SpaceToDepth", [f32(1, 4, 2, 2)], {}, 13, "blocksize"),
        ("ScatterND", [f32(2), i64([[0]]), f32(1)], {"reduction": "mean"}, 18, "reduction"),
        ("Cast", [f32(2)], {"to": 999}, 19, "to"),
        ("Cast", [f32(2)], {"to": TensorProto.FLOAT8E8M0, "round_mode": "odd"}, 24, "round_mode"),
        ("Unsqueeze", [f32(2)], {}, 11, "axes"),
    ],
)
def test_invalid_attributes_name_node_and_attribute(op, inputs, attrs, opset, attribute):
    with pytest.raises(InvalidGraphError, match=f"'n'.*{attribute}"):
        make_kernel(op, inputs, attrs, opset)
