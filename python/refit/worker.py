"""The worker side of a WorkerGroup: what each call of the driver runs inside a worker process.

A worker owns one checkpoint engine and a *program*, which says what this worker sends or does
with what it receives:

    class MyPolicyProgram:
        def stage(self, index): ...               # before refit `index` (not timed): get ready
        def weights(self, index): ...             # a source: iterable of (name, tensor)
        def kv_scales(self, index): ...           # a source, optional: {name: float} FP8 KV-cache scales
        def load(self, index, batch): ...         # a destination: one batch, a list of (name, tensor)
        def loader(self, index): ...              # a destination, instead of load: what receive_weights
                                                  # takes (a refit.ParameterLoader of its parameters)
        def report(self, index): ...              # anything picklable, returned to the driver

A program that is only the named tensors a worker holds is a ``TensorProgram(tensors)`` (below), or
just the mapping ``{name: tensor}``: a source sends them, a destination copies what arrives into them.

A source's ``kv_scales(index)`` (called after ``weights(index)``, before the send) gives the
calibrated FP8 KV-cache scales that ``send_weights(weights, kv_scales=...)`` appends to the
weights; its engine needs ``kv_cache_dtype="fp8"`` and a layer count (``engine_kwargs`` of
EngineWorker, e.g. ``{"kv_cache_dtype": "fp8", "model": path}``). None, or no such method: no
scales (an fp8 engine then sends 1.0 for every layer, as the reference does).

Ray actors, multiprocessing workers and the like subclass (or wrap) EngineWorker and forward the
driver's calls to it; refit.multiprocessing_group and python/examples/ray_refit.py do exactly that.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import ItemsView
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

from . import _refit
from .engine import CheckpointEngine, create_checkpoint_engine


class WorkerProgram(Protocol):
    def stage(self, index: int) -> None: ...

    def weights(self, index: int) -> Iterable[Tuple[str, Any]]: ...

    def kv_scales(self, index: int) -> Optional[Mapping[str, float]]: ...

    def load(self, index: int, batch: List[Tuple[str, Any]]) -> None: ...

    def report(self, index: int) -> Any: ...


def weight_specs_of(weights: Any, label: str) -> Optional[List[Tuple[str, str, Tuple[int, ...]]]]:
    """(name, dtype, shape) of every tensor of a state dict, its items or a list of (name, tensor),
    without touching the data; None for a generator (its tensors are known only as they come).
    A meta tensor raises InvalidArgumentError naming it (``label``: the sender)."""
    if isinstance(weights, Mapping):
        items = weights.items()
    elif isinstance(weights, (list, tuple, ItemsView)):
        items = weights
    else:
        return None
    specs = []
    for name, t in items:
        if getattr(getattr(t, "device", None), "type", None) == "meta":
            raise _refit.InvalidArgumentError(
                f"{label}: tensor '{name}' is a meta tensor (it has a shape but no data): materialize "
                f"the model's weights before sending them")
        specs.append((name, _refit.canonical_dtype(str(t.dtype)), tuple(int(d) for d in t.shape)))
    return specs


class TensorProgram:
    """A program that is only the named tensors a worker holds: a source sends them (through a
    refit.TensorSet), a destination copies what it receives into them by name (through a
    refit.ParameterLoader: a received tensor with no tensor of its name here, or of another dtype
    or shape, fails the refit with a LayoutError naming it, before anything of its batch is copied).

    ``tensors``: a mapping or (name, tensor) pairs, contiguous, in host memory or on one GPU (NumPy,
    PyTorch, CuPy), kept alive; a destination's are written in place. ``report``: called with no
    arguments after each refit, its value is the worker's report (default: ``{"tensors": n,
    "bytes": b}``). After a refit a destination's report first raises LayoutError naming the
    tensors it holds that no source sent (they keep their old values). A destination's EngineWorker
    receives with ``receive="callback"`` (its default), not "iterator".

        def program(role, rank):  # a ProcessWorkerGroup's program, run in each worker process
            w = np.zeros(1 << 20, np.float32)
            return refit.TensorProgram({"w": w}, report=lambda: float(w[-1]))
    """

    def __init__(self, tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]],
                 report: Optional[Callable[[], Any]] = None):
        self.tensors: Dict[str, Any] = {}
        for item in (tensors.items() if isinstance(tensors, Mapping) else tensors):
            if not isinstance(item, tuple) or len(item) != 2:
                raise _refit.InvalidArgumentError(
                    f"TensorProgram(tensors): expected a mapping or (name, tensor) pairs, got an item {item!r:.80}")
            name, tensor = item
            if name in self.tensors:
                raise _refit.InvalidArgumentError(f"TensorProgram: tensor '{name}' was given twice")
            self.tensors[name] = tensor
        self._report = report
        self._send: Optional[_refit.TensorSet] = None      # made at the first send
        self._load: Optional[_refit.ParameterLoader] = None  # made at the first receive
        self._loading = False  # loader() was asked for since the last stage() or report()
        self._bytes: Optional[int] = None

    def weight_specs(self, index: int) -> List[Tuple[str, str, Tuple[int, ...]]]:
        return [(name, dtype, tuple(shape)) for name, (dtype, shape, _) in self._infos()]

    def weights(self, index: int) -> _refit.TensorSet:
        if self._send is None:
            self._send = _refit.TensorSet(self.tensors)
        return self._send

    def loader(self, index: int) -> _refit.ParameterLoader:
        if self._load is None:
            self._load = _refit.ParameterLoader(self.tensors)
        self._loading = True
        return self._load

    def stage(self, index: int) -> None:
        if self._load is not None and self._loading:  # a refit that failed before its report: count afresh
            self._load.take_not_loaded()
            self._loading = False

    def report(self, index: int) -> Any:
        if self._load is not None and self._loading:
            self._loading = False
            missing = self._load.take_not_loaded()
            if missing:
                named = "', '".join(missing[:5]) + ("'" if len(missing) <= 5 else f"' and {len(missing) - 5} more")
                raise _refit.LayoutError(
                    f"refit {index}: no source sent {len(missing)} of the {len(self.tensors)} tensors this destination "
                    f"holds ('{named}); they still hold their old bytes")
        if self._report is not None:
            return self._report()
        if self._bytes is None:
            self._bytes = sum(nbytes for _, (_, _, nbytes) in self._infos())
        return {"tensors": len(self.tensors), "bytes": self._bytes}

    def _infos(self) -> List[Tuple[str, Tuple[str, Tuple[int, ...], int]]]:
        return [(name, _refit.tensor_info(t)) for name, t in self.tensors.items()]


class EngineWorker:
    """One worker: role "policy" (a source) or "rollout" (a destination), its rank, its program (a
    mapping of name to tensor is a TensorProgram of them).

    ``framework`` is how a destination receives tensors ("numpy", "torch", ... or "auto");
    ``receive`` how a destination drives a refit:
    "callback" (CheckpointEngine.receive_weights) or "iterator"
    (receive_weight_batches, the reference's generator); ``engine_kwargs``: engine options of this
    worker added to the driver's (e.g. ``kv_cache_dtype`` and ``model`` or ``num_layers`` for FP8
    KV-cache scales, ``layout`` for a destination), the driver's winning where both give a key."""

    def __init__(self, role: str, rank: int, program: Union[None, WorkerProgram, Mapping[str, Any]] = None, *,
                 framework: str = "auto", receive: str = "callback",
                 engine_kwargs: Optional[Mapping[str, Any]] = None):
        if receive not in ("callback", "iterator"):
            raise _refit.InvalidArgumentError(f"receive must be 'callback' or 'iterator', got {receive!r}")
        self.receive = receive
        if role not in ("policy", "rollout"):
            raise _refit.InvalidArgumentError(f"role must be 'policy' or 'rollout', got {role!r}")
        self.role = role
        self.rank = int(rank)
        self.program = TensorProgram(program) if isinstance(program, Mapping) else program
        if isinstance(self.program, TensorProgram) and role == "rollout" and receive == "iterator":
            raise _refit.InvalidArgumentError(f"destination rank {rank}: a TensorProgram loads through its "
                                              f"refit.ParameterLoader, with receive='callback', not 'iterator'")
        self.framework = framework
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: Optional[CheckpointEngine] = None
        self._engine_args: Optional[tuple] = None
        self._failed = False  # the last refit failed: replace the engine at the next prepare()

    @property
    def is_source(self) -> bool:
        return self.role == "policy"

    @property
    def label(self) -> str:
        return f"{'source' if self.is_source else 'destination'} rank {self.rank}"

    def total_memory_bytes(self, device: str) -> int:
        """Total memory of this worker's transfer device (capacity, not what is free)."""
        return _refit.total_device_memory_bytes(device)

    def create_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        """Creates the engine once; a worker that already has one keeps it (as in the reference)."""
        if self.engine is None:
            kwargs = {**self.engine_kwargs, **engine_kwargs}
            kwargs.setdefault("framework", self.framework)
            self._engine_args = (backend, bucket_size_bytes, kwargs)
            self.engine = create_checkpoint_engine(backend, bucket_size_bytes, kwargs)

    def prepare(self) -> bytes:
        """The engine's metadata. After a failed refit the engine is replaced first: messages of
        the failed refit may still be in flight to the old one, and a fresh engine (a fresh
        transport endpoint) never sees them."""
        if self._failed and self._engine_args is not None:
            _close(self._engine())
            self.engine = create_checkpoint_engine(*self._engine_args)
            self._failed = False
        return self._engine().prepare()

    def init_process_group(self, train_world_size: int, rollout_world_size: int, metadata: Sequence[bytes]) -> None:
        if self.is_source:
            self._engine().init_policy_process_group(self.rank, train_world_size, rollout_world_size, metadata)
        else:
            self._engine().init_rollout_process_group(self.rank, train_world_size, rollout_world_size, metadata)

    def stage(self, index: int) -> None:
        if self.program is not None and hasattr(self.program, "stage"):
            self.program.stage(index)

    def weight_specs(self, index: int) -> Optional[List[Tuple[str, str, Tuple[int, ...]]]]:
        """A source's (name, dtype, shape) list for refit ``index``, read from what its program's
        weights(index) returns without touching the data: the program's own ``weight_specs(index)``
        when it has one, else the items of a state dict or list; None for a generator (its
        tensors are known only as they come) and on a destination."""
        if not self.is_source or self.program is None:
            return None
        if hasattr(self.program, "weight_specs"):
            return self.program.weight_specs(index)
        return weight_specs_of(self.program.weights(index), self.label)

    def refit(self, index: int) -> dict:
        """One refit; returns {"role", "rank", "stats", "report"}; raises the refit's error."""
        engine = self._engine()
        try:
            if self.is_source:
                try:
                    weights = self.program.weights(index)
                    kv_scales = self.program.kv_scales(index) if hasattr(self.program, "kv_scales") else None
                except BaseException as e:
                    _fail_send(engine, e)  # its destination would otherwise wait its whole timeout_s
                    raise
                # Only when there are some: a plugin engine's send_weights may take weights alone.
                stats = engine.send_weights(weights) if kv_scales is None else \
                    engine.send_weights(weights, kv_scales=kv_scales)
            elif self.receive == "callback":
                # The framework is the engine's default (create_engine); a plugin takes `load` alone.
                program = self.program
                if hasattr(program, "loader"):  # e.g. a refit.ParameterLoader: batches load in C++
                    stats = engine.receive_weights(program.loader(index))
                else:
                    stats = engine.receive_weights(lambda batch: program.load(index, batch))
            else:
                it = engine.receive_weight_batches()
                with contextlib.closing(it):  # leaving early fails the refit, at once
                    for batch in it:
                        self.program.load(index, batch)
                stats = getattr(it, "stats", None)
        except BaseException:
            self._failed = True
            raise
        report = self.program.report(index) if hasattr(self.program, "report") else None
        return {"role": self.role, "rank": self.rank, "stats": stats, "report": report}

    def finalize(self) -> None:
        if self.engine is not None:
            self.engine.finalize()

    def close(self) -> None:
        if self.engine is not None:
            _close(self.engine)
            self.engine = None

    def _engine(self) -> CheckpointEngine:
        if self.engine is None:
            raise _refit.InvalidArgumentError(f"{self.label}: create_engine() has not run")
        return self.engine



def _fail_send(engine: Any, error: BaseException) -> None:
    """Ends this refit on the source's links with ``error`` as the reason: a send whose first pull
    raises it, which the engine reports to the destination before it gives up."""
    def stream():
        raise error
        yield  # noqa: unreachable - makes this a generator

    if not isinstance(engine, CheckpointEngine):  # a plugin's send may do anything with it
        return
    try:
        engine.send_weights(stream())
    except BaseException:  # noqa: BLE001 - the caller raises the error itself
        pass


def _close(engine: Any) -> None:
    """Frees an engine now: refit's have close(); a plugin may not (it is then only dropped)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


class BroadcastWorkerGroup:
    """The WorkerGroup calls, each made on every worker at once (sources first, then
    destinations, each by rank) through ``call_all``, which a subclass provides: over Ray actors,
    threads, processes. ``call_all(method, *args)`` calls the EngineWorker method of that name on
    every worker and returns their answers in order, or raises the first failure."""

    last_refit_seconds: Optional[float] = None

    def call_all(self, method: str, *args: Any) -> List[Any]:
        raise NotImplementedError

    def total_memory_bytes(self, device: str) -> List[int]:
        return self.call_all("total_memory_bytes", device)

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        self.call_all("create_engine", backend, bucket_size_bytes, dict(engine_kwargs))

    def prepare(self) -> List[bytes]:
        return self.call_all("prepare")

    def init_process_groups(self, metadata: Sequence[bytes]) -> None:
        self.call_all("init_process_group", self.train_world_size, self.rollout_world_size, list(metadata))

    def refit(self, index: int) -> List[Any]:
        self.call_all("stage", index)  # this refit's weights (not timed)
        start = time.perf_counter()
        try:
            return self.call_all("refit", index)
        finally:
            self.last_refit_seconds = time.perf_counter() - start

    def finalize(self) -> None:
        self.call_all("finalize")
