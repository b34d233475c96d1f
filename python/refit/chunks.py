"""Chunking helpers for checkpoint-engine plugins: cut a (name, tensor) stream into pieces no
larger than a bucket, and put received pieces back together.

refit's own engine does this in C++; these are for plugins (``module:ClassName`` backends) that
move bytes some other way and want the reference's chunk format::

    for meta, chunk in refit.split_weight_chunks(weights, bucket_size):
        ...  # place chunk (meta.chunk_size bytes) in a bucket at some offset, send meta with it

    for batch in refit.merge_weight_chunk_batches(received_batches):
        model.load_weights(batch)          # list of (name, tensor)

A chunk is a flat uint8 array of ``chunk_size`` bytes: bytes ``[chunk_offset, chunk_offset +
chunk_size)`` of the tensor's contiguous data. Chunks are cut at byte boundaries, not element
boundaries. NumPy arrays (bfloat16 and float8 through ml_dtypes) always work; PyTorch tensors work
when torch is installed (it is imported only if the caller already did).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from . import _refit


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Where one chunk belongs: the whole tensor's ``name``, ``shape`` and ``dtype`` (a NumPy
    dtype or a torch.dtype), and the chunk's byte range in that tensor's contiguous data
    (``chunk_offset``, ``chunk_size``). ``offset`` is the chunk's byte offset inside the bucket
    that carries it; the sender sets it (``dataclasses.replace(meta, offset=...)``), the
    helpers here do not use it."""

    name: str
    shape: Tuple[int, ...]
    dtype: Any
    chunk_offset: int
    chunk_size: int
    offset: int = 0

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (not of this chunk)."""
        return self.numel * self.itemsize

    @property
    def whole(self) -> bool:
        """This chunk is the whole tensor."""
        return self.chunk_offset == 0 and self.chunk_size == self.nbytes


# ---- framework glue ----

def _torch():
    """The torch module if the process already imported it (a torch tensor cannot exist otherwise)."""
    return sys.modules.get("torch")


def _is_torch(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _itemsize(dtype: Any) -> int:
    torch = _torch()
    if torch is not None and isinstance(dtype, torch.dtype):
        size = getattr(dtype, "itemsize", None)
        return int(size) if size is not None else torch.empty((), dtype=dtype).element_size()
    return np.dtype(dtype).itemsize


def _flat_bytes(name: str, tensor: Any) -> Tuple[Any, Tuple[int, ...], Any]:
    """(the tensor's contiguous data as a flat uint8 array, its shape, its dtype). Copies only a
    non-contiguous tensor."""
    if _is_torch(tensor):
        torch = _torch()
        t = tensor.detach().contiguous()
        return t.reshape(-1).view(torch.uint8), tuple(t.shape), t.dtype
    try:
        array = np.asarray(tensor)
    except Exception as e:  # noqa: BLE001
        raise _refit.InvalidArgumentError(
            f"split_weight_chunks: tensor '{name}' is a {type(tensor).__name__}, not a NumPy array or torch "
            f"tensor") from e
    if array.dtype.hasobject:
        raise _refit.InvalidArgumentError(
            f"split_weight_chunks: tensor '{name}' has dtype object (a {type(tensor).__name__}); expected a NumPy "
            f"array or torch tensor")
    shape = tuple(int(d) for d in array.shape)
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8), shape, array.dtype


def _chunk_bytes(meta: TensorMeta, chunk: Any) -> Any:
    """``chunk`` as a flat uint8 array (NumPy or torch), checked against meta.chunk_size."""
    if _is_torch(chunk):
        torch = _torch()
        flat = chunk.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        size = flat.numel()
    else:
        flat = np.asarray(chunk)
        if flat.dtype != np.uint8:
            flat = np.ascontiguousarray(flat).reshape(-1).view(np.uint8)
        flat = flat.reshape(-1)
        size = flat.size
    if size != meta.chunk_size:
        raise _refit.ProtocolError(
            f"merge_weight_chunk_batches: tensor '{meta.name}': the chunk at byte {meta.chunk_offset} has {size} "
            f"bytes, its metadata says chunk_size={meta.chunk_size}")
    return flat


# ---- splitting ----

def split_weight_chunks(weights: Iterable[Tuple[str, Any]], bucket_size: int, *, keep_empty: bool = False
                        ) -> Iterator[Tuple[TensorMeta, Any]]:
    """(TensorMeta, chunk) for every piece of every tensor, in input order: a tensor of at most
    ``bucket_size`` bytes is one chunk; a bigger one is ``ceil(nbytes / bucket_size)`` chunks,
    all but the last exactly ``bucket_size`` bytes. A chunk is a zero-copy uint8 view of the
    tensor's data (of a contiguous copy when the tensor was not contiguous); it is valid as long
    as the tensor is.

    A zero-byte tensor yields nothing, as in the reference (its receiver never hears of it);
    ``keep_empty=True`` yields one empty chunk for it instead, which merge_weight_chunk_batches
    turns back into an empty tensor (refit's engine delivers empty tensors too).
    Raises InvalidArgumentError for ``bucket_size < 1`` or a value that is not a tensor.
    """
    bucket_size = int(bucket_size)
    if bucket_size < 1:
        raise _refit.InvalidArgumentError(f"split_weight_chunks: bucket_size must be >= 1 byte, got {bucket_size}")
    for name, tensor in weights:
        data, shape, dtype = _flat_bytes(name, tensor)
        nbytes = int(data.numel()) if _is_torch(data) else int(data.size)
        if nbytes == 0:
            if keep_empty:
                yield TensorMeta(name, shape, dtype, 0, 0), data[:0]
            continue
        for start in range(0, nbytes, bucket_size):
            size = min(bucket_size, nbytes - start)
            yield TensorMeta(name, shape, dtype, start, size), data[start:start + size]


# ---- merging ----

class _Merge:
    """One tensor being put together from chunks, in any order."""

    def __init__(self, meta: TensorMeta, like: Any, device: Optional[Any]):
        self.meta = meta
        self.ranges: List[Tuple[int, int]] = []  # received byte ranges, sorted, disjoint
        self.received = 0
        if _is_torch(like):
            torch = _torch()
            target_device = device if device is not None else ("cpu" if like.is_cuda else like.device)
            self.tensor = torch.empty(meta.shape, dtype=meta.dtype, device=target_device)
            self.bytes = self.tensor.view(-1).view(torch.uint8)
        else:
            self.tensor = np.empty(meta.shape, dtype=meta.dtype)
            self.bytes = self.tensor.reshape(-1).view(np.uint8)

    def add(self, meta: TensorMeta, chunk: Any) -> bool:
        """Copies the chunk in; True when the tensor is complete."""
        if (meta.shape, meta.dtype) != (self.meta.shape, self.meta.dtype):
            raise _refit.ProtocolError(
                f"merge_weight_chunk_batches: tensor '{meta.name}': a chunk says shape {meta.shape} dtype "
                f"{meta.dtype}, an earlier chunk said shape {self.meta.shape} dtype {self.meta.dtype}")
        start, end = meta.chunk_offset, meta.chunk_offset + meta.chunk_size
        i = bisect.bisect_left(self.ranges, (start, end))
        neighbours = self.ranges[max(i - 1, 0):i + 1]
        for lo, hi in neighbours:
            if start < hi and lo < end:
                raise _refit.ProtocolError(
                    f"merge_weight_chunk_batches: tensor '{meta.name}': bytes [{start}, {end}) overlap bytes "
                    f"[{lo}, {hi}) received earlier")
        self.ranges.insert(i, (start, end))
        if _is_torch(self.bytes):
            self.bytes[start:end].copy_(chunk)
        else:
            self.bytes[start:end] = chunk if not _is_torch(chunk) else chunk.cpu().numpy()
        self.received += meta.chunk_size
        return self.received == self.meta.nbytes

    def missing(self) -> List[Tuple[int, int]]:
        gaps, at = [], 0
        for lo, hi in self.ranges:
            if lo > at:
                gaps.append((at, lo))
            at = hi
        if at < self.meta.nbytes:
            gaps.append((at, self.meta.nbytes))
        return gaps


def _whole_tensor(meta: TensorMeta, chunk: Any) -> Any:
    if _is_torch(chunk):
        return chunk.view(meta.dtype).view(meta.shape)
    return chunk.view(meta.dtype).reshape(meta.shape)


def merge_weight_chunk_batches(batches: Iterable[Iterable[Tuple[TensorMeta, Any]]], *,
                               merge_device: Optional[Any] = None) -> Iterator[List[Tuple[str, Any]]]:
    """Whole tensors back from received chunks: for every input batch (the (TensorMeta, chunk)
    pairs of one bucket), the list of (name, tensor) pairs it completes, in the order they
    complete; a batch that completes nothing yields nothing.

    - A chunk that is the whole tensor becomes a zero-copy view of the chunk (valid as long as
      the chunk's memory is: for a transfer buffer, until the next bucket lands in it).
    - Other chunks are copied into a new tensor that is emitted (owned) once all its bytes
      arrived. Chunks of one tensor may arrive in any order and interleaved with other tensors'.
      PyTorch: the new tensor is on ``merge_device``, by default the CPU for CUDA chunks (as in
      the reference) and the chunk's device otherwise; NumPy: host memory.

    Raises ProtocolError naming the tensor when a chunk's size is not its metadata's
    ``chunk_size``, when a chunk falls outside the tensor, when chunks overlap or disagree on
    shape and dtype, and, after the last batch, for every tensor with bytes missing (a gap).
    """
    merging: Dict[str, _Merge] = {}
    for batch in batches:
        out: List[Tuple[str, Any]] = []
        for meta, chunk in batch:
            nbytes = meta.nbytes
            if meta.chunk_offset < 0 or meta.chunk_size < 0 or meta.chunk_offset + meta.chunk_size > nbytes:
                raise _refit.ProtocolError(
                    f"merge_weight_chunk_batches: tensor '{meta.name}': chunk bytes [{meta.chunk_offset}, "
                    f"{meta.chunk_offset + meta.chunk_size}) fall outside its {nbytes} bytes (shape {meta.shape}, "
                    f"dtype {meta.dtype})")
            data = _chunk_bytes(meta, chunk)
            if meta.chunk_size == 0 and nbytes > 0:
                raise _refit.ProtocolError(
                    f"merge_weight_chunk_batches: tensor '{meta.name}': an empty chunk at byte {meta.chunk_offset} of "
                    f"a {nbytes}-byte tensor")
            if meta.whole and meta.name not in merging:
                out.append((meta.name, _whole_tensor(meta, data)))
                continue
            merge = merging.get(meta.name)
            if merge is None:
                merge = merging[meta.name] = _Merge(meta, data, merge_device)
            if merge.add(meta, data):
                del merging[meta.name]
                out.append((meta.name, merge.tensor))
        if out:
            yield out
    if merging:
        parts = []
        for name, merge in merging.items():
            gaps = ", ".join(f"[{lo}, {hi})" for lo, hi in merge.missing())
            parts.append(f"'{name}' ({merge.received} of {merge.meta.nbytes} bytes; missing {gaps})")
        raise _refit.ProtocolError(
            f"merge_weight_chunk_batches: the chunk stream ended with incomplete tensor(s): {'; '.join(parts)}")
