"""A refit.WorkerGroup over Ray actors, for drivers that run refit inside Ray (pip install ray).

    import ray, refit
    from refit.ray import RayWorkerGroup

    Policy = ray.remote(refit.EngineWorker)          # or a subclass that makes its own program
    policy = [Policy.remote("policy", r, make_policy_program(r)) for r in range(T)]
    rollout = [Policy.remote("rollout", r, make_rollout_program(r)) for r in range(R)]
    group = RayWorkerGroup(policy, rollout, timeout_s=config.timeout_s)
    sync = refit.WeightSynchronizer(config, group)
    sync.sync_weights()

Every call of the driver runs on all actors at once (``actor.method.remote``) and gathers the
answers as they come; a failure is the worker's own exception (Ray's wrapper removed), with the
other failures attached as notes. An actor that died, or that does not answer within ``grace_s``
of another failure (its host is gone and Ray has not noticed yet), is lost until ``replace()``.
python/examples/ray_refit.py runs it on one host, python/tests/test_hosts_ray.py across simulated
hosts with a host killed mid-refit.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import ray

from . import _refit
from .worker import BroadcastWorkerGroup


def _cause(error: BaseException) -> BaseException:
    """The worker's own exception inside a Ray error (same type, same message)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


class RayWorkerGroup(BroadcastWorkerGroup):
    """A refit.WorkerGroup over Ray actors (refit.EngineWorker each, or a subclass), on one host
    or many: sources first, then destinations, each by rank.

    Every call runs on all actors at once and gathers the answers as they come. After the first
    failure the others get ``grace_s`` more to answer; an actor that does not answer by then (its
    host is gone and Ray has not noticed yet) or whose actor died is *lost*: later calls fail at
    once for it until ``replace()`` puts a new actor in its place. Each call has a deadline
    (``call_timeout_s``; a refit's is the engines' own, timeout_s, plus ``grace_s``). The first
    failure is raised (the worker's own exception) with the others attached as notes."""

    def __init__(self, policy: Sequence[Any], rollout: Sequence[Any], *, timeout_s: float = 300.0,
                 grace_s: float = 2.0, call_timeout_s: float = 60.0):
        self.policy = list(policy)
        self.rollout = list(rollout)
        self.timeout_s = float(timeout_s)
        self.grace_s = float(grace_s)
        self.call_timeout_s = float(call_timeout_s)
        self.lost: Dict[int, str] = {}  # index in policy + rollout -> why

    @property
    def train_world_size(self) -> int:
        return len(self.policy)

    @property
    def rollout_world_size(self) -> int:
        return len(self.rollout)

    @property
    def actors(self) -> List[Any]:
        return self.policy + self.rollout

    def label(self, i: int) -> str:
        t = len(self.policy)
        return f"source rank {i}" if i < t else f"destination rank {i - t}"

    def replace(self, role: str, rank: int, actor: Any) -> None:
        """Puts a new actor in place of a lost one (the synchronizer gives it an engine at its next
        sync_weights(), with the group's session and bucket size)."""
        if role == "policy":
            self.policy[rank] = actor
            self.lost.pop(rank, None)
        else:
            self.rollout[rank] = actor
            self.lost.pop(len(self.policy) + rank, None)

    def call_all(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        if timeout_s is None and method == "refit":
            timeout_s = self.timeout_s + self.grace_s  # the engines' own deadline, then the grace
        actors = self.actors
        results: List[Any] = [None] * len(actors)
        failures: List[tuple] = []
        pending: Dict[Any, int] = {}
        for i, actor in enumerate(actors):
            if i in self.lost:
                failures.append((i, _refit.PeerLostError(
                    f"{self.label(i)} was lost earlier ({self.lost[i]}); replace its actor")))
            else:
                pending[getattr(actor, method).remote(*args)] = i
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.call_timeout_s)
        if failures:
            deadline = min(deadline, time.monotonic() + self.grace_s)
        while pending:
            remaining = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, remaining))
            if not ready:
                break
            for ref in ready:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self.lost[i] = f"its actor is gone: {type(e).__name__}"
                    failures.append((i, e))
                except ray.exceptions.RayTaskError as e:
                    failures.append((i, _cause(e)))
                else:
                    continue
                deadline = min(deadline, time.monotonic() + self.grace_s)
        for ref, i in pending.items():
            why = f"no answer to '{method}' within {self.grace_s:g} s of another failure" if failures \
                else f"no answer to '{method}' within its deadline"
            self.lost[i] = why
            failures.append((i, _refit.RefitTimeoutError(f"{self.label(i)}: {why}")))
        if failures:
            failures.sort(key=lambda f: f[0])
            first = failures[0][1]
            for i, e in failures[1:]:
                if hasattr(first, "add_note"):
                    first.add_note(f"also {self.label(i)} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            raise first
        return results
