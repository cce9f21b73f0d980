"""The provider's own operator domain: the kernels that no ONNX operator matches exactly, which its fusion passes
write (fusions.py and the passes beside it). A module of its own so that the kernel families and the fused
operators' shape rules name the domain without importing the passes: a session whose plans are cached runs none."""

FUSED_DOMAIN = "ai.onnx_runtime.cpu"

# FusedConv's inputs past the Conv's (x, w, b): the residual z added to its output, and, for a convolution that writes
# its channels of a Concat (conv_fusions.fuse_concat_convs), the concatenation the convolutions before it filled.
CONV_RESIDUAL, CONV_INTO = 3, 4


def concat_part(node) -> bool:
    """Whether ``node`` is a FusedConv that writes its channels of a Concat (its ``concat_channels``)."""
    return node.op_type == "FusedConv" and node.domain == FUSED_DOMAIN and node.attr("concat_channels") is not None
