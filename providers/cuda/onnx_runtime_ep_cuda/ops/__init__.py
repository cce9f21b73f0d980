"""CUDA kernels, one module per operator family. Importing this package fills the registry."""
from . import (
    attention,  # noqa: F401
    channel_norm,  # noqa: F401
    conv,  # noqa: F401
    data,  # noqa: F401
    elementwise,  # noqa: F401
    linalg,  # noqa: F401
    normalization,  # noqa: F401
    reduce,  # noqa: F401
)
