"""Helpers for the refit Python tests: a source/destination pair of engines in one process (each
side on its own thread), and worker functions that run in spawned processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import refit

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY_MOE = os.path.join(REPO, "data", "models", "refit-tiny-moe")


def config(**overrides: Any) -> refit.RefitConfig:
    kwargs = {"timeout_s": 20}
    kwargs.update(overrides)
    return refit.as_config(kwargs)


class Pair:
    """A connected source and destination engine in this process."""

    def __init__(self, bucket_bytes: int, cfg: Optional[refit.RefitConfig] = None, *,
                 framework: str = "numpy", layout: Optional[refit.Layout] = None, receives_only: bool = False,
                 source_options: Optional[Dict[str, Any]] = None, destination_options: Optional[Dict[str, Any]] = None):
        cfg = cfg or config()
        self.session = session = refit.new_session_id()
        self.source = refit.CheckpointEngine(bucket_bytes, cfg, session=session, **(source_options or {}))
        self.destination = refit.CheckpointEngine(bucket_bytes, cfg, session=session, framework=framework,
                                                  layout=layout, receives_only=receives_only,
                                                  **(destination_options or {}))
        self.connect()

    def connect(self) -> None:
        md = [self.source.prepare(), self.destination.prepare()]
        self.source.init_policy_process_group(0, 1, 1, md)
        self.destination.init_rollout_process_group(0, 1, 1, md)

    def start_send(self, weights, **send_kwargs: Any) -> "Sender":
        return Sender(self.source, weights, **send_kwargs)

    def refit(self, weights, load: Callable[[List[Tuple[str, Any]]], None] = None,
              send_kwargs: Optional[Dict[str, Any]] = None, **receive_kwargs: Any) -> Tuple[dict, dict]:
        sender = self.start_send(weights, **(send_kwargs or {}))
        it = self.destination.receive_weight_batches(**receive_kwargs)
        for batch in it:
            if load:
                load(batch)
        return sender.join(), it.stats

    def close(self) -> None:
        self.destination.close()
        self.source.close()


class Sender(threading.Thread):
    """Runs send_weights on a thread; join() returns its stats or raises its error."""

    def __init__(self, engine: refit.CheckpointEngine, weights, **send_kwargs: Any) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.weights = weights
        self.send_kwargs = send_kwargs
        self.stats: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self.stats = self.engine.send_weights(self.weights, **self.send_kwargs)
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def join(self, timeout: Optional[float] = 60) -> dict:  # type: ignore[override]
        super().join(timeout)
        if self.is_alive():
            raise AssertionError("send_weights did not return")
        if self.error is not None:
            raise self.error
        return self.stats


class ThreadWorkerGroup(refit.BroadcastWorkerGroup):
    """A refit.WorkerGroup over refit.EngineWorker objects of this process (sources first), each
    call made on one thread per worker (the engines talk over UCX as between processes)."""

    def __init__(self, workers: List[refit.EngineWorker]):
        self.workers = workers

    @property
    def train_world_size(self) -> int:
        return sum(1 for w in self.workers if w.is_source)

    @property
    def rollout_world_size(self) -> int:
        return sum(1 for w in self.workers if not w.is_source)

    def call_all(self, method: str, *args: Any) -> List[Any]:
        return call_on_threads([getattr(w, method) for w in self.workers], *args)

    def close(self) -> None:
        for w in self.workers:
            w.close()


def call_on_threads(calls: List[Callable[..., Any]], *args: Any) -> List[Any]:
    """Runs every call with `args` at once, one thread each; returns their results in order or
    raises the first failure."""
    results: List[Any] = [None] * len(calls)
    errors: List[Optional[BaseException]] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i](*args)
        except BaseException as e:  # noqa: BLE001
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a worker call did not return"
    for e in errors:
        if e is not None:
            raise e
    return results


def hashes(weights) -> Dict[str, int]:
    return {name: refit.xxh3_64(np.ascontiguousarray(t) if isinstance(t, np.ndarray) else t) for name, t in weights}


# ---- code that runs in spawned processes ----------------------------------------------------------

def destination_process(conn, bucket_bytes: int, session: bytes, cfg_yaml: str, refits: int) -> None:
    """A destination in its own process: prepare, send metadata, get everyone's, receive `refits`
    refits, hashing every tensor, then finalize; reports over `conn`."""
    try:
        engine = refit.create_checkpoint_engine("nixl", bucket_bytes, {"nixl": refit.parse_config(cfg_yaml),
                                                                       "session": session, "framework": "numpy"})
        conn.send(engine.prepare())
        metadata = conn.recv()
        engine.init_rollout_process_group(0, 1, 1, metadata)
        for _ in range(refits):
            got = {}
            it = engine.receive_weight_batches()
            for batch in it:
                for name, tensor in batch:
                    got[name] = (refit.xxh3_64(tensor), tensor.dtype.name, tuple(tensor.shape))
            conn.send(("refit", got, it.stats, engine.stale))
        engine.finalize()
        conn.send(("done", engine.stale))
        engine.close()
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", e))


@contextlib.contextmanager
def source_with_destination_process(cfg: "refit.RefitConfig", refits: int, bucket_bytes: int = 1 << 20):
    """A source engine here and a destination_process() in a spawned process, connected (their
    metadata crossing by pickle): yields (source, conn), where each conn.recv() is one refit's
    report. On leaving, the destination must have finalized, not stale, and exited with 0."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    session = refit.new_session_id()
    proc = ctx.Process(target=destination_process, args=(child, bucket_bytes, session, cfg.to_yaml(), refits),
                       daemon=True)
    proc.start()
    try:
        source = refit.create_checkpoint_engine("nixl", bucket_bytes, {"nixl": cfg, "session": session})
        md_source = source.prepare()
        assert isinstance(md_source, bytes)
        md_destination = parent.recv()
        if isinstance(md_destination, tuple):
            raise md_destination[1]
        metadata = pickle.loads(pickle.dumps([md_source, md_destination]))
        parent.send(metadata)
        source.init_policy_process_group(0, 1, 1, metadata)
        yield source, parent
        assert parent.recv() == ("done", False)
        source.finalize()
        source.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


def nixl_region_process(conn, payload: bytes) -> None:
    """A NIXL transport in its own process holding `payload` in a registered buffer: sends its
    address and the buffer's (address, length, key), connects to the parent's transport, then
    waits until told to exit, answering messages in the meantime."""
    import time

    from refit.nixl import NixlTransport

    transport = NixlTransport(refit.as_config({"backend_name": "NIXL"}))
    buffer = np.frombuffer(bytearray(payload), np.uint8)
    region = transport.register(buffer.ctypes.data, buffer.nbytes, -1)
    conn.send((transport.address(), buffer.ctypes.data, buffer.nbytes, transport.describe(region)))
    peer = transport.connect(conn.recv(), "the parent")
    while not conn.poll(0.001):
        message = transport.poll(peer)  # also progresses NIXL, so that reads of our buffer complete
        if message is not None:
            transport.send(peer, message[::-1])
        time.sleep(0.0005)
    conn.recv()
