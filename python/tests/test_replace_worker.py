"""Replacing a worker after a failed refit (a lost host, a dead actor): the synchronizer gives every
worker an engine again at the next sync_weights() — with the same session and bucket size — so a
new worker put in place of the lost one takes part, and those that have an engine keep it.

The group here runs refit.EngineWorker objects of this process, each call on one thread per worker
(the engines talk over UCX as between processes)."""

from __future__ import annotations

from typing import Any, List

import pytest

import refit
from refit.testing import HashingDestination, SyntheticSource, verify

import helpers
from helpers import TINY_MOE

LIMIT = 60  # the first 60 tensors of refit-tiny-moe


class ReplaceableGroup(helpers.ThreadWorkerGroup):
    """helpers.ThreadWorkerGroup over synthetic sources and hashing destinations; it records the
    calls it gets, and a test swaps a worker with new_destination()."""

    def __init__(self, sources: int, destinations: int):
        super().__init__([refit.EngineWorker("policy", r, SyntheticSource(TINY_MOE, limit=LIMIT))
                          for r in range(sources)] + [self.new_destination(r) for r in range(destinations)])
        self.calls: List[str] = []

    @staticmethod
    def new_destination(rank: int, fail_at=None) -> refit.EngineWorker:
        return refit.EngineWorker("rollout", rank, HashingDestination(fail_at=fail_at), framework="numpy")

    def call_all(self, method: str, *args: Any) -> List[Any]:
        self.calls.append(method)
        return super().call_all(method, *args)


def test_a_worker_replaced_after_a_failed_refit_gets_an_engine_and_the_next_refit_is_verified():
    group = ReplaceableGroup(2, 2)
    try:
        # Destination rank 1 fails in refit 1 (its loader raises): "the host is lost".
        group.workers[3] = group.new_destination(1, fail_at=1)
        sync = refit.WeightSynchronizer({"bucket_bytes": "4MiB", "timeout_s": 30}, group)
        assert verify(sync.sync_weights().results, 2) == []
        kept = [w.engine for w in group.workers[:3]]
        with pytest.raises(refit.RefitError, match="destination rank 1|synthetic failure"):
            sync.sync_weights()
        assert sync.stale and not sync.ready

        # A new worker (no engine) takes the lost one's place; the next sync creates its engine.
        group.workers[3].close()
        group.workers[3] = group.new_destination(1)
        assert group.workers[3].engine is None
        group.calls.clear()
        report = sync.sync_weights()
        assert verify(report.results, 2) == [] and not sync.stale
        assert group.calls == ["create_engine", "prepare", "init_process_group", "stage", "refit"]
        assert group.workers[3].engine is not None
        assert group.workers[3].engine.bucket_size == 4 << 20
        # Workers that had an engine kept it (source 1 and destination 0 succeeded in refit 1; a
        # worker whose refit failed replaces its engine at prepare(), as before).
        assert group.workers[0].engine is kept[0] and group.workers[2].engine is kept[2]

        # Without a failure, nothing is created again.
        group.calls.clear()
        assert verify(sync.sync_weights().results, 2) == []
        assert group.calls == ["stage", "refit"]
    finally:
        group.close()


def test_engines_are_created_again_with_the_first_session():
    class Recording:
        train_world_size = 1
        rollout_world_size = 1

        def __init__(self):
            self.sessions = []
            self.fail = True

        def total_memory_bytes(self, device):
            return [1 << 34, 1 << 34]

        def create_engines(self, backend, bucket_size_bytes, engine_kwargs):
            self.sessions.append((bucket_size_bytes, engine_kwargs["session"]))

        def prepare(self):
            return [b"a", b"b"]

        def init_process_groups(self, metadata):
            pass

        def refit(self, index):
            if self.fail:
                raise refit.PeerLostError("lost destination rank 0 on host h4")
            return [None, True]

        def finalize(self):
            pass

    group = Recording()
    sync = refit.WeightSynchronizer(None, group)
    with pytest.raises(refit.PeerLostError):
        sync.sync_weights()
    group.fail = False
    sync.sync_weights()
    sync.sync_weights()
    assert len(group.sessions) == 2 and group.sessions[0] == group.sessions[1]
    assert len(group.sessions[0][1]) == 16
