"""CUDA kernels, one module per operator family. Importing this package fills the registry."""
