"""The checkpoint binding's backend on CuPy arrays (reference/binding.py)."""

from __future__ import annotations

import numpy as np

try:
    import cupy
except ImportError:  # the backend is simply unavailable
    cupy = None


class CupyBindingBackend:
    """The binding layer's backend protocol (reference/binding.py,
    NumpyBackend) on CuPy arrays: a checkpoint lease is uploaded once, and
    recipes (slice, concat, transpose, cast) run on the device. `alias`
    returns the very same array: the tied unembedding shares its storage.
    bfloat16 arrays are held as their uint16 bits (CuPy has no bfloat16);
    a cast rounds to nearest even on the host's rules (ml_dtypes)."""

    name = "cupy"

    def from_host(self, array: np.ndarray, dtype: str):
        return cupy.asarray(self._host(np.ascontiguousarray(array), dtype))

    @staticmethod
    def _host(array: np.ndarray, dtype: str) -> np.ndarray:
        import ml_dtypes

        if dtype == "float32":
            return array.astype(np.float32)  # bfloat16 widens exactly
        return array.astype(ml_dtypes.bfloat16).view(np.uint16)  # RNE, kept as bits

    def slice(self, x, axis: int, start: int, stop: int):
        index = (slice(None),) * axis + (slice(start, stop),)
        return cupy.ascontiguousarray(x[index])

    def concat(self, xs, axis: int):
        return cupy.concatenate(list(xs), axis=axis)

    def transpose(self, x):
        return cupy.ascontiguousarray(x.T)

    def cast(self, x, dtype: str):
        # bits held as uint16 are bfloat16; the rounding itself follows the host's rules
        host = cupy.asnumpy(x)
        if host.dtype == np.uint16:
            import ml_dtypes

            host = host.view(ml_dtypes.bfloat16)
        return cupy.asarray(self._host(host, dtype))

    def alias(self, x):
        return x
