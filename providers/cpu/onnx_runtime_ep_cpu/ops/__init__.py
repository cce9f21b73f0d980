"""numpy kernels, one module per operator family, each imported at the first lookup of one of its operators
(registry.declare_families): a session imports the families its model uses. FAMILIES names what each module
registers ("Op" for ai.onnx, "domain:Op" otherwise); an operator missing here still finds its kernel, after
every module is imported. tests/core/test_cold_lazy_ops.py checks the table against the registrations.
"""

from ..registry import declare_families

FAMILIES = {
    "activation": "Celu Elu Gelu HardSigmoid LeakyRelu PRelu Relu Selu ThresholdedRelu",
    "contrib_activation": (
        "com.microsoft:BiasAdd com.microsoft:BiasGelu com.microsoft:BiasSplitGelu com.microsoft:FastGelu "
        "com.microsoft:Gelu com.microsoft:QuickGelu"
    ),
    "contrib_linalg": "com.microsoft:FusedConv com.microsoft:FusedMatMul",
    "contrib_normalization": (
        "SimplifiedLayerNormalization com.microsoft:EmbedLayerNormalization "
        "com.microsoft:SkipLayerNormalization com.microsoft:SkipSimplifiedLayerNormalization"
    ),
    "contrib_qattention": "com.microsoft:QAttention com.microsoft:QEmbedLayerNormalization",
    "contrib_integer_matmul": "com.microsoft:DynamicQuantizeMatMul com.microsoft:MatMulIntegerToFloat",
    "contrib_qlinear_activation": (
        "com.microsoft:QLinearLeakyRelu com.microsoft:QLinearSigmoid com.microsoft:QLinearSoftmax"
    ),
    "contrib_qlinear_binary": "com.microsoft:QLinearAdd com.microsoft:QLinearMul",
    "contrib_qlinear_concat": "com.microsoft:QLinearConcat com.microsoft:QLinearWhere",
    "contrib_qlinear_gemm": "com.microsoft:QGemm",
    "contrib_qlinear_pool": "com.microsoft:QLinearAveragePool com.microsoft:QLinearGlobalAveragePool",
    "contrib_quantization": "com.microsoft:DequantizeLinear com.microsoft:QuantizeLinear",
    "contrib_transformer": (
        "com.microsoft:Attention com.microsoft:GroupQueryAttention com.microsoft:MultiHeadAttention "
        "com.microsoft:RotaryEmbedding ai.onnx_runtime.cpu:ContribAttentionMask "
        "ai.onnx_runtime.cpu:ContribPackedAttention"
    ),
    "contrib_weights": "com.microsoft:GatherBlockQuantized com.microsoft:MatMulNBits",
    "control_flow": "If Loop Scan",
    "code_table": "ai.onnx_runtime.cpu:CodeTable",
    "conv": "Conv ConvTranspose ai.onnx_runtime.cpu:ConcatBuffer ai.onnx_runtime.cpu:FusedConv",
    "conv_nhwc": "ai.onnx_runtime.cpu:NhwcConv",
    "detection": "NonMaxSuppression RoiAlign",
    "flex_attention": "ai.onnx.preview:FlexAttention",
    "linear_attention": "CausalConvWithState LinearAttention",
    "rounded_output": (
        "ai.onnx_runtime.cpu:AddRounded ai.onnx_runtime.cpu:SubRounded ai.onnx_runtime.cpu:MulRounded "
        "ai.onnx_runtime.cpu:DivRounded ai.onnx_runtime.cpu:PowRounded ai.onnx_runtime.cpu:MaxRounded "
        "ai.onnx_runtime.cpu:MinRounded ai.onnx_runtime.cpu:SoftmaxRounded "
        "ai.onnx_runtime.cpu:LayerNormalizationRounded ai.onnx_runtime.cpu:CastRounded "
        "ai.onnx_runtime.cpu:NegRounded ai.onnx_runtime.cpu:SqrtRounded ai.onnx_runtime.cpu:ReciprocalRounded "
        "ai.onnx_runtime.cpu:TanhRounded ai.onnx_runtime.cpu:SigmoidRounded ai.onnx_runtime.cpu:ErfRounded "
        "ai.onnx_runtime.cpu:ExpRounded ai.onnx_runtime.cpu:AbsRounded ai.onnx_runtime.cpu:ReluRounded "
        "ai.onnx_runtime.cpu:ConcatRounded ai.onnx_runtime.cpu:ReduceMeanRounded "
        "ai.onnx_runtime.cpu:ReduceSumRounded ai.onnx_runtime.cpu:GatherRounded "
        "ai.onnx_runtime.cpu:UnsqueezeRounded ai.onnx_runtime.cpu:SqueezeRounded "
        "ai.onnx_runtime.cpu:ReshapeRounded ai.onnx_runtime.cpu:TransposeRounded "
        "ai.onnx_runtime.cpu:ExpandRounded ai.onnx_runtime.cpu:SliceRounded ai.onnx_runtime.cpu:WhereRounded"
    ),
    "segment": "ai.onnx_runtime.cpu:FusedSegment",
    "spectrum": "ai.onnx_runtime.cpu:SpectralMagnitude",
    "dropout": "Dropout",
    "dynamic_quantize_conv": "ai.onnx_runtime.cpu:DynamicQuantizeConv",
    "dynamic_quantize_group": "ai.onnx_runtime.cpu:DynamicQuantizeMatMulGroup "
                              "ai.onnx_runtime.cpu:DynamicQuantizeMatMulColumns",
    "dynamic_quantize_fused": "ai.onnx_runtime.cpu:DynamicQuantizeFusedMatMul",
    "patch_embedding": "ai.onnx_runtime.cpu:PatchEmbedding",
    "past_attention": "ai.onnx_runtime.cpu:PastAttention",
    "projection_group": "ai.onnx_runtime.cpu:ProjectionGroup",
    "qdq_group": "ai.onnx_runtime.cpu:QuantizedMatMulGroup",
    "elementwise": (
        "Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor "
        "Cast CastLike Ceil Clip Cos Cosh Div Equal Erf Exp Floor Greater GreaterOrEqual HardSwish Identity "
        "IsInf IsNaN Less LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or Pow Reciprocal Round Sigmoid "
        "Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Tan Tanh Where Xor"
    ),
    "fused": (
        "ai.onnx_runtime.cpu:ReshapeTranspose ai.onnx_runtime.cpu:RotateHalfEmbedding "
        "ai.onnx_runtime.cpu:SkipRMSNormalization ai.onnx_runtime.cpu:SwishMul ai.onnx_runtime.cpu:GeluMul "
        "ai.onnx_runtime.cpu:TransposeReshape"
    ),
    "generator": (
        "Bernoulli Constant ConstantOfShape EyeLike RandomNormal RandomNormalLike RandomUniform "
        "RandomUniformLike Range"
    ),
    "gradient": "ai.onnx.preview.training:Gradient",
    "grid_table": "ai.onnx_runtime.cpu:GridTable ai.onnx_runtime.cpu:ChannelGridTable",
    "image": "AffineGrid CenterCropPad Col2Im DeformConv GridSample ImageDecoder MaxUnpool",
    "linalg": "Einsum Gemm MatMul ai.onnx_runtime.cpu:FusedMatMul",
    "loss": "NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss",
    "ml": (
        "ai.onnx.ml:ArrayFeatureExtractor ai.onnx.ml:Binarizer ai.onnx.ml:LabelEncoder "
        "ai.onnx.ml:TreeEnsemble"
    ),
    "normalization": (
        "BatchNormalization GroupNormalization InstanceNormalization LRN LayerNormalization "
        "ai.onnx_runtime.cpu:FusedBatchNormalization"
    ),
    "numeric": "CumProd Det LpNormalization MeanVarianceNormalization ReverseSequence Shrink Swish TensorScatter",
    "pad": "Pad",
    "pool": "AveragePool GlobalAveragePool GlobalLpPool GlobalMaxPool LpPool MaxPool",
    "precision": "ai.onnx_runtime.cpu:FloatToHalf ai.onnx_runtime.cpu:HalfToFloat ai.onnx_runtime.cpu:RoundToHalf",
    "qdq_add": "ai.onnx_runtime.cpu:QuantizedAdd",
    "qdq_gelu": "ai.onnx_runtime.cpu:RoundedGelu",
    "qdq_norm": "ai.onnx_runtime.cpu:RoundedRMSNorm",
    "qdq_rotary": "ai.onnx_runtime.cpu:RoundedRotary",
    "qdq_grouped": "ai.onnx_runtime.cpu:GroupedQuantizedMatMul",
    "qdq_attention": "ai.onnx_runtime.cpu:RoundedAttention",
    "qdq_linear": (
        "QLinearMatMul ai.onnx_runtime.cpu:QLinearMatMulAdd ai.onnx_runtime.cpu:QuantizedConv "
        "ai.onnx_runtime.cpu:QuantizedMatMul"
    ),
    "quantization": (
        "BitCast ConvInteger DequantizeLinear DynamicQuantizeLinear MatMulInteger QLinearConv QuantizeLinear "
        "ai.onnx_runtime.cpu:QuantizeDequantize"
    ),
    "recurrent": "GRU LSTM RNN ai.onnx_runtime.cpu:LSTMCell",
    "reduction": (
        "ArgMax ArgMin CumSum ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
        "ReduceProd ReduceSum ReduceSumSquare"
    ),
    "resize": "Resize Upsample",
    "sequence": (
        "ConcatFromSequence Optional OptionalGetElement OptionalHasElement SequenceAt SequenceConstruct "
        "SequenceEmpty SequenceErase SequenceInsert SequenceLength SequenceMap SplitToSequence"
    ),
    "shape": (
        "Compress Concat DepthToSpace Expand Gather GatherElements GatherND NonZero OneHot Scatter ScatterElements "
        "ScatterND Shape Size Slice SpaceToDepth Split Tile TopK Trilu Unique"
    ),
    "signal": "BlackmanWindow DFT HammingWindow HannWindow MelWeightMatrix STFT",
    "softmax": "Hardmax LogSoftmax Softmax",
    "text": "RegexFullMatch StringConcat StringNormalizer StringSplit TfIdfVectorizer",
    "training": "ai.onnx.preview.training:Adagrad ai.onnx.preview.training:Adam ai.onnx.preview.training:Momentum",
    "transformer": "Attention",
    "transformer_blocks": "RMSNormalization RotaryEmbedding SwiGLU",
    "view": "Flatten Reshape Squeeze Transpose Unsqueeze",
}

declare_families(__name__, __path__, FAMILIES)
