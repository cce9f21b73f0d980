"""CPU simulator of the CUDA driver: ``sim.driver`` stands in for ``cuda.bindings.driver`` when
ONNX_RUNTIME_CUDA_SIM=1, running the provider's CUDA C++ kernels compiled for the host against cuda_emu.h."""
