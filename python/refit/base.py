"""What every checkpoint engine offers: refit's own (refit.CheckpointEngine) and the plugins that
``create_checkpoint_engine("module:ClassName", ...)`` loads.

A plugin subclasses CheckpointEngineBase and implements the six abstract methods with the
reference's meaning; ``create_checkpoint_engine`` constructs it as
``cls(bucket_size=bucket_size_bytes, **engine_kwargs)``. Everything else has a default built on
those six: ``receive_weights`` (a callback per batch) and the async forms
``send_weights_async``, ``receive_weight_batches_async`` and ``receive_weights_async``, which run
the blocking calls on a worker thread. A plugin whose transfers are natively async may override
them.

Cancelling an async call (task.cancel(), a timeout around it) fails the refit, as stopping a
blocking one early does: the destination stays stale and the source gets an error (or, when the
source is the one cancelled, the destination does). The engine's waits cannot be interrupted
from Python, so the refit stops at its next step (the next tensor pulled from the weights, the
next batch); the cancelled task finishes once the worker thread has returned, so the engine is
idle again when the CancelledError reaches the caller (at most about ``timeout_s`` for refit's
engine). A second cancel during that wait does not cut it short.

The async forms use the event loop's default executor, one thread per call in flight (two for a
source and a destination awaited in one loop, plus one while a cancel is handled): an executor
of a single thread would make them wait on each other.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Tuple

from . import _refit

Batch = List[Tuple[str, Any]]


class CheckpointEngineBase(abc.ABC):
    """The checkpoint-engine interface (the reference's ``CheckpointEngine`` ABC).

    Lifecycle on every worker: ``prepare()`` → the driver gathers every worker's metadata,
    sources first → ``init_policy_process_group`` (a source) or ``init_rollout_process_group``
    (a destination) → per refit ``send_weights`` / ``receive_weight_batches`` → ``finalize()``.
    One thread drives an engine at a time.
    """

    @abc.abstractmethod
    def prepare(self) -> Any:
        """Allocates what transfers need and returns this engine's metadata (picklable)."""

    @abc.abstractmethod
    def init_policy_process_group(self, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata: Any) -> None:
        """A source (policy rank ``worker_rank``): connects to its destination, if it has one."""

    @abc.abstractmethod
    def init_rollout_process_group(self, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata: Any) -> None:
        """A destination (rollout rank ``rollout_rank``): connects to its source."""

    @abc.abstractmethod
    def send_weights(self, weights: Iterable[Tuple[str, Any]]) -> Any:
        """One refit from a source: sends every (name, tensor) pair; returns once the destination
        has everything. A source without a destination still consumes ``weights``."""

    @abc.abstractmethod
    def receive_weight_batches(self) -> Iterator[Batch]:
        """One refit at a destination: an iterator of batches (lists of (name, tensor))."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Disconnects from the peers (and frees transfer memory if the engine was told to)."""

    def get_target_weight_layout(self) -> Any:
        """On a source: the layout its destination asked for, or None for whole tensors.
        Engines that support ``shard_expert_weights`` must override this."""
        return None

    # ---- defaults built on the abstract methods ----

    def receive_weights(self, load: Callable[[Batch], Any]) -> Any:
        """One refit at a destination, calling ``load(batch)`` for every batch. Returns the
        iterator's ``stats`` attribute if it has one."""
        it = self.receive_weight_batches()
        try:
            for batch in it:
                load(batch)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return getattr(it, "stats", None)

    async def send_weights_async(self, weights: Iterable[Tuple[str, Any]],
                                 kv_scales: Optional[Mapping[str, float]] = None) -> Any:
        """``send_weights`` on a worker thread. ``weights`` is an ordinary iterable, consumed on
        that thread. ``kv_scales`` (FP8 KV-cache scales) is passed on to ``send_weights`` when
        not None (a plugin's send_weights that takes none is called without it). Cancelled: the
        next pull from ``weights`` raises, which fails the refit (if the last tensor was already
        pulled, the refit may still complete; the call raises CancelledError either way)."""
        cancelled = threading.Event()

        def guarded() -> Iterator[Tuple[str, Any]]:
            for item in weights:
                if cancelled.is_set():
                    break
                yield item
                if cancelled.is_set():
                    break
            if cancelled.is_set():
                raise asyncio.CancelledError("send_weights_async() was cancelled")

        if kv_scales is None:
            return await _in_thread(lambda: self.send_weights(guarded()), on_cancel=cancelled.set)
        return await _in_thread(lambda: self.send_weights(guarded(), kv_scales=kv_scales), on_cancel=cancelled.set)

    def receive_weight_batches_async(self, *args: Any, **kwargs: Any) -> "AsyncBatchIterator":
        """``async for batch in engine.receive_weight_batches_async(): ...``: the batches of
        ``receive_weight_batches(*args, **kwargs)``, each awaited from a worker thread. The
        same lifetime rules: a batch's views are valid until the next one is awaited. Leaving
        the loop early fails the refit; use ``async with`` (or ``aclose()``) so that happens at
        once, without blocking the event loop."""
        return AsyncBatchIterator(self.receive_weight_batches(*args, **kwargs))

    async def receive_weights_async(self, load: Callable[[Batch], Any], *args: Any, **kwargs: Any) -> Any:
        """``receive_weights(load, ...)`` on a worker thread: ``load`` runs on that thread, not
        on the event loop. Cancelled: the next call of ``load`` raises instead, which fails the
        refit."""
        cancelled = threading.Event()

        def guarded(batch: Batch) -> Any:
            if cancelled.is_set():
                raise asyncio.CancelledError("receive_weights_async() was cancelled")
            return load(batch)

        return await _in_thread(lambda: self.receive_weights(guarded, *args, **kwargs), on_cancel=cancelled.set)


class AsyncBatchIterator:
    """An async iterator over a refit's batches; see CheckpointEngineBase.receive_weight_batches_async.
    ``stats`` (and refit's ``error``, ``batches``, ``running``) are the wrapped iterator's."""

    def __init__(self, iterator: Iterator[Batch]):
        self._it = iterator
        self._done = False
        # refit's BatchIterator can be closed while another thread waits in its __next__ (that
        # makes the wait end); a Python generator cannot ("generator already executing").
        self._close_while_waiting = isinstance(iterator, _refit.BatchIterator)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._it, name)

    def __aiter__(self) -> "AsyncBatchIterator":
        return self

    async def __anext__(self) -> Batch:
        if self._done:
            raise StopAsyncIteration
        end = object()
        on_cancel = self._close_now if self._close_while_waiting else None
        try:
            batch = await _in_thread(lambda: next(self._it, end), on_cancel=on_cancel)
        except asyncio.CancelledError:
            self._done = True
            if not self._close_while_waiting:
                self._close_now()
            raise
        except BaseException:
            self._done = True
            raise
        if batch is end:
            self._done = True
            raise StopAsyncIteration
        return batch

    def _close_now(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    async def aclose(self) -> None:
        """Stops the refit if it is still running (it then fails; the destination stays stale)."""
        if self._done:
            return
        self._done = True
        await _in_thread(self._close_now)

    async def __aenter__(self) -> "AsyncBatchIterator":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


async def _in_thread(func: Callable[[], Any], on_cancel: Optional[Callable[[], Any]] = None) -> Any:
    """``func()`` on the loop's default executor. When the awaiting task is cancelled:
    ``on_cancel()`` (also on the executor: it may block), then wait until ``func`` has returned,
    and raise CancelledError. ``func``'s own result or error after a cancel is dropped."""
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, func)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        waits = [future]
        if on_cancel is not None:
            waits.append(loop.run_in_executor(None, on_cancel))
        while not all(w.done() for w in waits):
            try:
                await asyncio.wait(waits)
            except asyncio.CancelledError:
                continue  # the engine must be idle before anyone may use it again
        for w in waits:
            if not w.cancelled():
                w.exception()  # retrieved: asyncio would log it as never retrieved
        raise
