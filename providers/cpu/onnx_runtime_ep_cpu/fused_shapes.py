"""The shape rule of every operator the provider's fusions write (domain fusions.FUSED_DOMAIN), declared to the
session's shape analysis (onnx_runtime.session.shape_rules) as the nodes they replace were known to it.

Each kernel registered in FUSED_DOMAIN must appear here (tests/cpu/test_qdq_decoder_shapes.py walks the
registry): a fused operator left out hides every shape downstream of it, and a decode step's shape work then
runs per call. Operand indices name the inputs a rule reads (QuantizedMatMul: A codes, then its scale and zero
point, then B codes)."""
from __future__ import annotations

from onnx_runtime.session.shape_rules import BROADCAST, CONCAT, FIRST, MATMUL, SAME, SHAPES, declare

from .fused_domain import FUSED_DOMAIN

# A producer with its rounding as an epilogue (qdq_epilogues.py) is the op type SUFFIX appended to the producer's;
# the producers whose rounding folds, by the shape rule their output follows. (Here, not in qdq_epilogues.py: the
# provider declares these rules at import, and a session whose plans are cached runs no pass.)
SUFFIX = "Rounded"
BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")
ELEMENTWISE = ("Softmax", "LayerNormalization", "Cast", "Neg", "Sqrt", "Reciprocal", "Tanh", "Sigmoid", "Erf",
               "Exp", "Abs", "Relu")
SHAPED = ("Concat", "ReduceMean", "ReduceSum", "Gather", "Unsqueeze", "Squeeze", "Reshape", "Transpose", "Expand",
          "Slice", "Where")

RULES: dict[str, tuple[str, tuple[int, ...]]] = {
    # float16 conversions (precision_fusions.py): output i is input i converted
    "RoundToHalf": (SAME, ()), "HalfToFloat": (SAME, ()), "FloatToHalf": (SAME, ()),
    # elementwise maps of input 0 (qdq_fusions.py, code_tables.py, qdq_gelu.py, qdq_tables.py)
    "QuantizeDequantize": (FIRST, (0,)), "CodeTable": (FIRST, (0,)), "RoundedGelu": (FIRST, (0,)),
    "GridTable": (FIRST, (0,)), "ChannelGridTable": (FIRST, (0,)), "RoundedRMSNorm": (FIRST, (0,)),
    "RoundedRotary": (FIRST, (0,)),
    # normalizations and rotations over input 0's last axes (fusions.py, conv_fusions.py)
    "SkipRMSNormalization": (FIRST, (0,)), "RotateHalfEmbedding": (FIRST, (0,)),
    "FusedBatchNormalization": (FIRST, (0,)),
    "SwishMul": (BROADCAST, (0, 1)), "GeluMul": (BROADCAST, (0, 1)),
    # integer products: MatMul's shape over the codes of A and B (qdq_fusions.py, code_tables.py)
    "QuantizedMatMul": (MATMUL, (0, 3)), "QLinearMatMulAdd": (MATMUL, (0, 3)),
    # the attention's context (qdq_attention.py): MatMul's shape over q and the values, its inputs 0 and 1
    "RoundedAttention": (MATMUL, (0, 1)),
    "DynamicQuantizeFusedMatMul": (MATMUL, (0, 1)),
    # output shapes from the inputs' shapes and attributes by the op's own rule
    "FusedMatMul": (SHAPES, ()), "DynamicQuantizeMatMulGroup": (SHAPES, ()),
    "DynamicQuantizeMatMulColumns": (SHAPES, ()), "QuantizedConv": (SHAPES, ()),
    "GroupedQuantizedMatMul": (SHAPES, ()),
    "DynamicQuantizeConv": (SHAPES, ()), "QuantizedAdd": (BROADCAST, (0, 3)),
    "FusedConv": (SHAPES, ()), "NhwcConv": (SHAPES, ()), "ConcatBuffer": (SHAPES, ()), "ReshapeTranspose": (SHAPES, ()),
    "TransposeReshape": (SHAPES, ()), "ContribPackedAttention": (SHAPES, ()), "ContribAttentionMask": (SHAPES, ()),
    "LSTMCell": (SHAPES, ()), "FusedSegment": (SHAPES, ()), "SpectralMagnitude": (SHAPES, ()),
    "ProjectionGroup": (SHAPES, ()), "PatchEmbedding": (SHAPES, ()), "QuantizedMatMulGroup": (SHAPES, ()),
    "PastAttention": (SHAPES, ()),
}

# producers with their rounding as an epilogue (qdq_epilogues.py): the producer's own rule
RULES.update({op + SUFFIX: (BROADCAST, (0, 1)) for op in BROADCASTING})
RULES.update({op + SUFFIX: (FIRST, (0,)) for op in ELEMENTWISE})
RULES.update({op + SUFFIX: (SHAPES, ()) for op in SHAPED if op != "Concat"})
RULES["Concat" + SUFFIX] = (CONCAT, (2,))  # (its parts, then the rounding's scale and zero point)

for _op, (_kind, _operands) in RULES.items():
    declare(FUSED_DOMAIN, _op, _kind, _operands)
