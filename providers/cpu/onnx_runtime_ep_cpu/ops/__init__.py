"""numpy kernels, one module per operator family. Importing this package fills the registry."""

from . import (  # noqa: F401  (imported for their @register side effects)
    elementwise,
    generator,
    linalg,
    nn,
    reduction,
    shape,
)
