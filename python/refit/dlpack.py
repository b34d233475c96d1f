"""DLPack helpers: how tensors cross between Python frameworks and refit.

In (send_weights): any object with ``__dlpack__`` or the buffer protocol: NumPy arrays, PyTorch
tensors (CPU and CUDA; tensors that require grad are detached), CuPy arrays, JAX arrays...
Contiguity is required: a non-contiguous tensor is made contiguous (torch ``.contiguous()``,
NumPy ``ascontiguousarray``; a copy) or, for other types, refused with an error naming it.
NumPy arrays of ml_dtypes' bfloat16 / float8_e4m3fn / float8_e5m2 are read as their bits.
A build of refit without the CUDA data path (refit.cuda_built() is False) copies GPU tensors to
host memory first (``.cpu()`` / ``.get()``), one tensor at a time.

Out (receive_weight_batches): views on refit's memory as ``framework``:
"torch" (torch.Tensor), "numpy" (numpy.ndarray; bfloat16 and float8 as ml_dtypes arrays), "cupy",
or "dlpack" (a bare object with ``__dlpack__``, ``__dlpack_device__`` and the buffer protocol,
for any other framework's ``from_dlpack``).

Dtypes refit moves: bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64,
float8_e4m3fn, float8_e5m2.
"""

from __future__ import annotations

from typing import Any, Tuple

from . import _refit

#: dtypes refit moves, by PyTorch name
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "float8_e4m3fn", "float8_e5m2")


def tensor_info(tensor: Any) -> Tuple[str, tuple, int]:
    """(dtype name, shape, nbytes) of a tensor as refit reads it; raises like send_weights would."""
    return _refit.tensor_info(tensor)


def to_torch(tensor: Any):
    """A torch.Tensor sharing the memory of a received tensor of any framework."""
    import torch
    if isinstance(tensor, torch.Tensor):
        return tensor
    return torch.from_dlpack(tensor)


def to_numpy(tensor: Any):
    """A NumPy array sharing the memory of a host tensor (bfloat16/float8 need ml_dtypes)."""
    import numpy as np
    if isinstance(tensor, np.ndarray):
        return tensor
    if hasattr(tensor, "numpy") and hasattr(tensor, "dtype") and "torch" in type(tensor).__module__:
        name = str(tensor.dtype).replace("torch.", "")
        if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            import ml_dtypes
            raw = tensor.view(getattr(__import__("torch"), "int16" if tensor.element_size() == 2 else "uint8"))
            return raw.numpy().view(getattr(ml_dtypes, name))
        return tensor.numpy()
    return np.from_dlpack(tensor)
