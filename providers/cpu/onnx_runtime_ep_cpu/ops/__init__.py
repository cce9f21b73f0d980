"""numpy kernels, one module per operator family. Importing this package fills the registry."""

from . import (  # noqa: F401  (imported for their @register side effects)
    control_flow,
    elementwise,
    fused,
    generator,
    gradient,
    image,
    linalg,
    loss,
    ml,
    nn,
    numeric,
    quantization,
    recurrent,
    reduction,
    sequence,
    shape,
    signal,
    text,
    training,
    transformer,
)
