"""Worker programs for tests, examples and benchmarks: sources that stream a model's tensors with
synthetic content that changes every refit, destinations that hash what they receive, and a check
that every destination tensor matches its source bitwise (XXH3-64 per tensor, as `refit bench`).

    source = SyntheticSource("data/models/refit-tiny-moe")        # NumPy arrays in host memory
    source = SyntheticSource(path, backend="torch", device="cuda")  # torch CUDA tensors
    destination = HashingDestination()
    problems = verify(report)                                     # [] when every tensor matched
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from . import _refit

_NUMPY_DTYPES = {
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64,
}
_ALIGN = 64


def numpy_dtype(name: str):
    """The NumPy dtype of a refit dtype name; bfloat16 and float8 come from ml_dtypes."""
    name = _refit.canonical_dtype(name)
    if name in _NUMPY_DTYPES:
        return np.dtype(_NUMPY_DTYPES[name])
    try:
        import ml_dtypes
    except ImportError as e:
        raise _refit.UnsupportedError(
            f"NumPy has no {name} dtype: install ml_dtypes (pip install ml-dtypes)") from e
    return np.dtype(getattr(ml_dtypes, name))


def default_model_path() -> str:
    """The built-in default model (a scaled-down Qwen3-MoE compiled into the package)."""
    return _refit.DEFAULT_MODEL


class SyntheticSource:
    """Streams every tensor of a model (a config.json or safetensors inventory) with bytes that
    depend on the refit index, and remembers each tensor's hash.

    backend "numpy" (default) holds NumPy arrays; "torch" holds torch tensors on ``device``
    ("cpu", "cuda", "cuda:N"): the content is made on the host and copied to the GPU at stage().
    """

    def __init__(self, model: Optional[str] = None, *, backend: str = "numpy", device: str = "cpu",
                 limit: Optional[int] = None, fail_at: Optional[int] = None):
        self.fail_at = fail_at
        self.inventory = _refit.load_model_inventory(model or default_model_path())
        self.tensors = list(self.inventory.tensors)[:limit]
        self.backend = backend
        self.device = device
        total = sum((t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN for t in self.tensors)
        self._storage = np.zeros(max(total, 1), dtype=np.uint8)
        self._host: List[Tuple[str, np.ndarray]] = []
        offset = 0
        for t in self.tensors:
            raw = self._storage[offset: offset + t.nbytes]
            self._host.append((t.name, raw.view(numpy_dtype(t.dtype)).reshape(t.shape)))
            offset += (t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self._tensors: List[Tuple[str, Any]] = list(self._host)
        self.hashes: Dict[str, str] = {}

    def stage(self, index: int) -> None:
        self.hashes = {}
        for i, (name, array) in enumerate(self._host):
            _refit.fill_synthetic(array, index * 1000003 + i)
            self.hashes[name] = f"{_refit.xxh3_64(array):016x}"
        if self.backend == "torch":
            self._tensors = [(name, _to_torch(array, self.device)) for name, array in self._host]
            if self.device.startswith("cuda"):
                import torch
                torch.cuda.synchronize()

    def weights(self, index: int) -> Iterator[Tuple[str, Any]]:
        if index == self.fail_at:
            return self._failing(index)
        return iter(self._tensors)

    def _failing(self, index: int) -> Iterator[Tuple[str, Any]]:
        for i, item in enumerate(self._tensors):
            if i == len(self._tensors) // 2:
                raise RuntimeError(f"synthetic failure of the weight stream in refit {index}")
            yield item

    def report(self, index: int) -> Dict[str, Any]:
        return {"hashes": dict(self.hashes), "bytes": sum(t.nbytes for t in self.tensors)}


def _to_torch(array: np.ndarray, device: str):
    import torch
    name = array.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        raw = torch.from_numpy(array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8))
        tensor = raw.view(getattr(torch, name))
    else:
        tensor = torch.from_numpy(array)
    return tensor.to(device) if device != "cpu" else tensor


class HashingDestination:
    """Hashes every tensor it receives (names must not repeat within a refit)."""

    def __init__(self, fail_at: Optional[int] = None) -> None:
        self.fail_at = fail_at
        self.hashes: Dict[str, str] = {}
        self.bytes = 0
        self.batches = 0
        self._index: Optional[int] = None

    def stage(self, index: int) -> None:
        pass

    def load(self, index: int, batch: List[Tuple[str, Any]]) -> None:
        if index != self._index:
            self._index, self.hashes, self.bytes, self.batches = index, {}, 0, 0
        self.batches += 1
        if index == self.fail_at and self.batches == 2:
            raise RuntimeError(f"synthetic failure of the loader in refit {index}")
        for name, tensor in batch:
            if name in self.hashes:
                raise _refit.IntegrityError(f"tensor '{name}' received twice in refit {index}")
            self.hashes[name] = f"{_refit.xxh3_64(tensor):016x}"
            self.bytes += _refit.tensor_info(tensor)[2]

    def report(self, index: int) -> Dict[str, Any]:
        if index != self._index:  # nothing arrived (an empty model)
            self._index, self.hashes, self.bytes, self.batches = index, {}, 0, 0
        return {"hashes": dict(self.hashes), "bytes": self.bytes, "batches": self.batches}


def loading_destination(model: Optional[str] = None, limit: Optional[int] = None):
    """A destination that does what `refit bench`'s do: copies every tensor into NumPy parameters of
    its own, allocated once (a refit.TensorProgram: refit.ParameterLoader), and hashes them in its
    report, after the timed refit."""
    from .worker import TensorProgram
    inventory = _refit.load_model_inventory(model or default_model_path())
    parameters = {t.name: np.empty(tuple(t.shape), numpy_dtype(t.dtype)) for t in list(inventory.tensors)[:limit]}
    return TensorProgram(parameters, report=lambda: {
        "hashes": {name: f"{_refit.xxh3_64(p):016x}" for name, p in parameters.items()},
        "bytes": sum(p.nbytes for p in parameters.values())})


class SyntheticPrograms:
    """A picklable program factory for worker groups: sources are SyntheticSource(model, ...),
    destinations HashingDestination() (``destination="hash"``, the default) or
    loading_destination(model) (``"load"``). ``fail_at``: (role, rank, refit index) at which that
    worker's program raises (for failure tests; hashing destinations)."""

    def __init__(self, model: Optional[str] = None, *, backend: str = "numpy", device: str = "cpu",
                 limit: Optional[int] = None, fail_at: Optional[Tuple[str, int, int]] = None,
                 destination: str = "hash"):
        if destination not in ("hash", "load"):
            raise _refit.InvalidArgumentError(f"SyntheticPrograms(destination={destination!r}): expected 'hash' or "
                                              f"'load'")
        self.model = model or default_model_path()
        self.backend = backend
        self.device = device
        self.limit = limit
        self.fail_at = fail_at
        self.destination = destination

    def __call__(self, role: str, rank: int):
        fail = self.fail_at[2] if self.fail_at and self.fail_at[:2] == (role, rank) else None
        if role == "policy":
            return SyntheticSource(self.model, backend=self.backend, device=self.device, limit=self.limit,
                                   fail_at=fail)
        if self.destination == "load":
            return loading_destination(self.model, self.limit)
        return HashingDestination(fail_at=fail)


def verify(results: List[Any], train_world_size: int) -> List[str]:
    """Compares every destination's hashes with its source's (destination r is fed by source r).
    ``results``: a RefitReport's results (dicts from EngineWorker.refit). Returns the problems."""
    problems: List[str] = []
    sources, destinations = results[:train_world_size], results[train_world_size:]
    for rank, result in enumerate(destinations):
        expected = sources[rank]["report"]["hashes"]
        got = result["report"]["hashes"]
        for name, h in expected.items():
            if name not in got:
                problems.append(f"destination rank {rank}: tensor '{name}' missing")
            elif got[name] != h:
                problems.append(f"destination rank {rank}: tensor '{name}' differs ({got[name]} != {h})")
        for name in got.keys() - expected.keys():
            problems.append(f"destination rank {rank}: unexpected tensor '{name}'")
    return problems
