"""The emulated device behind the TensorRT / TensorRT-LLM stand-ins (tests only).

What a GPU and TensorRT's runtime would do, done eagerly with torch on the CPU:

* ``numerics``: how declared dtypes map to torch storage (``faithful``: the declared
  dtype, half types computed in float32 as TensorRT's kernels accumulate; ``exact``:
  every floating tensor held and computed in float64, so engine logic can be compared
  token for token with the PyTorch runtime in float64, as the lossless tests do).
* ``memory``: the emulated device memory. Engines see addresses, as on a GPU; an
  address that is not inside a live allocation is a fault (:class:`EmulatedMemoryFault`),
  never a read of garbage.
* ``graph``: evaluation of a recorded network: shape inference on meta tensors (shape
  tensors keep real values, as TensorRT computes them on the host), then execution in a
  seeded random topological order, so an ordering that is not a data dependency shows up.
"""

from .core import (  # noqa: F401
    DataDependentShape,
    EmulatedMemoryFault,
    EmulationError,
    device_memory,
    numerics_mode,
    physical_dtype,
    set_numerics,
)
