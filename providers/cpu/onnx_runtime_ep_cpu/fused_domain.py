"""The provider's own operator domain: the kernels that no ONNX operator matches exactly, which its fusion passes
write (fusions.py and the passes beside it). A module of its own so that the kernel families and the fused
operators' shape rules name the domain without importing the passes: a session whose plans are cached runs none."""

FUSED_DOMAIN = "ai.onnx_runtime.cpu"
