"""A WorkerGroup of processes on this host, started with multiprocessing's "spawn" method (UCX
and CUDA do not survive fork). Each worker runs an EngineWorker in a command loop over a pipe.

    group = ProcessWorkerGroup(
        sources=2, destinations=2,
        program=make_program,            # picklable callable: make_program(role, rank) -> program,
                                         # or a mapping {name: tensor} (refit.TensorProgram)
        framework="numpy")
    sync = WeightSynchronizer(config, group)
    report = sync.sync_weights()
    group.close()

A worker that dies is noticed at once (its pipe closes), and every call still gathers every other
worker's answer, so the error raised names every failure (the first one is raised, the others
are attached as notes).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal
import time
from typing import Any, Callable, List, Mapping, Optional, Sequence

from . import _refit
from .worker import BroadcastWorkerGroup, EngineWorker

ProgramFactory = Callable[[str, int], Any]


def _worker_main(conn, role: str, rank: int, program_factory: ProgramFactory, options: dict,
                 log_level: Optional[str]) -> None:
    if log_level:
        _refit.set_log_level(log_level)
    worker = EngineWorker(role, rank, program_factory(role, rank) if program_factory else None, **options)
    while True:
        try:
            command, args = conn.recv()
        except (EOFError, OSError):
            break
        if command == "exit":
            break
        try:
            result = getattr(worker, command)(*args)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the driver
            try:
                conn.send(("error", e))
            except Exception:  # an exception that does not pickle
                conn.send(("error", _refit.RefitError(f"{type(e).__name__}: {e}")))
    worker.close()


class _Worker:
    def __init__(self, ctx, role: str, rank: int, factory, options: dict, log_level: Optional[str]):
        self.role = role
        self.rank = rank
        self.label = f"{'source' if role == 'policy' else 'destination'} rank {rank}"
        parent, child = ctx.Pipe()
        self.conn = parent
        self.process = ctx.Process(target=_worker_main, name=f"refit-{role}-{rank}",
                                   args=(child, role, rank, factory, options, log_level),
                                   daemon=True)
        self.process.start()
        child.close()
        self.dead = False


def _describe_exit(process) -> str:
    code = process.exitcode
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _attach_notes(error: BaseException, notes: Sequence[str]) -> BaseException:
    for note in notes:
        if hasattr(error, "add_note"):
            error.add_note(note)
    return error


class ProcessWorkerGroup(BroadcastWorkerGroup):
    """``sources`` policy workers and ``destinations`` rollout workers, each its own process.
    ``destinations=0`` makes a policy side for destinations driven elsewhere (refit.vllm_adapter).

    ``program``: a picklable callable ``program(role, rank)`` run inside each worker, returning
    its WorkerProgram (refit.worker), or the tensors the worker holds: a refit.TensorProgram, or
    just a mapping ``{name: tensor}`` (a source sends them, a destination copies what it receives
    into them). ``framework``/``receive``: how destinations
    receive (refit.EngineWorker). ``engine_kwargs``: engine options every worker adds to the
    driver's (refit.EngineWorker), e.g. ``{"kv_cache_dtype": "fp8", "model": path}``.
    ``timeout_s``: the longest the driver waits for one call (None: forever; the engines' own
    deadlines bound every transfer anyway).
    """

    def __init__(self, sources: int, destinations: int, program: ProgramFactory, *, framework: str = "auto",
                 receive: str = "callback", timeout_s: Optional[float] = None,
                 log_level: Optional[str] = None, engine_kwargs: Optional[Mapping[str, Any]] = None):
        if sources < 1 or destinations < 0:
            raise _refit.TopologyError(f"need at least one source and no negative count of destinations, got "
                                       f"{sources} and {destinations}")
        ctx = mp.get_context("spawn")
        options = {"framework": framework, "receive": receive,
                   "engine_kwargs": dict(engine_kwargs or {})}
        self._timeout = timeout_s
        self._workers: List[_Worker] = []
        try:
            for rank in range(sources):
                self._workers.append(_Worker(ctx, "policy", rank, program, options, log_level))
            for rank in range(destinations):
                self._workers.append(_Worker(ctx, "rollout", rank, program, options, log_level))
        except BaseException:
            self.close()
            raise
        self._sources = sources
        self._destinations = destinations

    # ---- WorkerGroup ----

    @property
    def train_world_size(self) -> int:
        return self._sources

    @property
    def rollout_world_size(self) -> int:
        return self._destinations

    # ---- beyond the protocol ----

    def stage(self, index: int) -> None:
        """Runs every program's stage(index) (e.g. makes a source's weights), outside the refit."""
        self._call("stage", index)

    @property
    def pids(self) -> List[int]:
        """Worker pids, sources first."""
        return [w.process.pid for w in self._workers]

    def call_all(self, method: str, *args: Any) -> List[Any]:
        """Runs EngineWorker.<method>(*args) on every worker."""
        return self._call(method, *args)

    def close(self) -> None:
        """Asks every worker to exit, then terminates what is left (bounded)."""
        for w in self._workers:
            if not w.dead:
                try:
                    w.conn.send(("exit", ()))
                except (OSError, BrokenPipeError):
                    pass
        deadline = time.monotonic() + 10
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(5)
            w.conn.close()
        self._workers = []

    def __enter__(self) -> "ProcessWorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- internals ----

    def _call(self, command: str, *args: Any) -> List[Any]:
        results: List[Any] = [None] * len(self._workers)
        failures: List[tuple] = []  # (index, exception)
        pending = {}
        for i, w in enumerate(self._workers):
            if w.dead:
                failures.append((i, _refit.PeerLostError(f"{w.label} is gone ({_describe_exit(w.process)})")))
                continue
            try:
                w.conn.send((command, args))
                pending[w.conn] = i
            except (OSError, BrokenPipeError):
                w.dead = True
                failures.append((i, _refit.PeerLostError(f"{w.label} is gone ({_describe_exit(w.process)})")))
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        sentinels = {self._workers[i].process.sentinel: conn for conn, i in pending.items()}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp.connection.wait(list(pending) + list(sentinels), remaining)
            if not ready:
                for conn, i in pending.items():
                    failures.append((i, _refit.RefitTimeoutError(
                        f"{self._workers[i].label} did not answer '{command}' within {self._timeout} s")))
                break
            for r in ready:
                conn = sentinels.get(r, r)
                if conn not in pending:
                    continue
                i = pending[conn]
                w = self._workers[i]
                if r is conn or conn.poll():
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "dead", None
                else:
                    status, value = "dead", None
                if status == "dead":
                    w.process.join(1)
                    w.dead = True
                    value = _refit.PeerLostError(
                        f"{w.label} (pid {w.process.pid}) died during '{command}': {_describe_exit(w.process)}")
                    status = "error"
                del pending[conn]
                sentinels.pop(w.process.sentinel, None)
                if status == "ok":
                    results[i] = value
                else:
                    failures.append((i, value))
        if failures:
            failures.sort(key=lambda f: f[0])
            first = failures[0][1]
            notes = [f"{self._workers[failures[0][0]].label} failed: {type(first).__name__}"]
            notes += [f"also {self._workers[i].label} failed: {type(e).__name__}: {e}" for i, e in failures[1:]]
            raise _attach_notes(first, notes)
        return results
