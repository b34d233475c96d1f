"""The Python WeightSynchronizer over a multiprocessing worker group (spawned processes, UCX):
memory query -> bucket size, prepare, metadata exchange, connect, refits checked bitwise, a failed
refit raised as an error, release, re-init."""

from __future__ import annotations

import pytest

import refit
from refit.multiprocessing_group import ProcessWorkerGroup
from refit.testing import SyntheticPrograms, verify

from helpers import TINY_MOE

MiB = 1 << 20
# 24 GiB hosts get 24 MiB buckets: the 62.5 MiB embedding is split over buckets and merged.
RATIO = 0.001


class CountingGroup:
    """Wraps a WorkerGroup and records the calls the synchronizer makes."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if callable(attr):
            def call(*args):
                self.calls.append(name)
                return attr(*args)
            return call
        return attr


@pytest.mark.parametrize("receive", ["callback", "iterator"])
def test_refits_over_a_process_group_are_verified(receive):
    inventory = refit.load_model_inventory(TINY_MOE)
    with ProcessWorkerGroup(2, 2, SyntheticPrograms(TINY_MOE), framework="numpy", receive=receive,
                            timeout_s=300) as inner:
        group = CountingGroup(inner)
        assert isinstance(inner, refit.WorkerGroup)
        sync = refit.WeightSynchronizer({"update_weights_bucket_memory_ratio": RATIO, "timeout_s": 60}, group,
                                        model_fingerprint=inventory.fingerprint)
        assert sync.stale and not sync.ready
        expected_bucket = int(refit.total_host_memory_bytes() * RATIO) // MiB * MiB
        for index in range(3):
            report = sync.sync_weights()
            assert report.index == index and report.seconds > 0
            assert verify(report.results, 2) == []
            for r in report.destination_results:
                assert r["stats"]["tensors"] == len(inventory.tensors)
                assert r["stats"]["payload_bytes"] == inventory.total_bytes
            assert not sync.stale and sync.ready
        assert sync.bucket_size.bytes == expected_bucket
        # Once: memory query, engines, prepare, init; then only refits.
        assert group.calls == ["total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                               "refit", "refit", "refit"]
        # shutdown() finalizes; the next refit prepares again with fresh metadata.
        sync.shutdown()
        assert not sync.ready
        report = sync.sync_weights()
        assert verify(report.results, 2) == []
        assert group.calls[-4:] == ["finalize", "prepare", "init_process_groups", "refit"]


def test_release_after_refit_finalizes_after_every_refit():
    with ProcessWorkerGroup(1, 1, SyntheticPrograms(TINY_MOE, limit=60), framework="numpy") as inner:
        group = CountingGroup(inner)
        sync = refit.WeightSynchronizer({"bucket_bytes": "8MiB", "release_after_refit": True, "timeout_s": 60}, group)
        for _ in range(2):
            report = sync.sync_weights()
            assert verify(report.results, 1) == [] and not sync.ready
        assert group.calls == ["total_memory_bytes", "create_engines", "prepare", "init_process_groups", "refit",
                               "finalize", "prepare", "init_process_groups", "refit", "finalize"]
        assert sync.bucket_size.bytes == 8 * MiB


@pytest.mark.parametrize("fail_at", [("rollout", 1, 1), ("policy", 0, 1)])
def test_a_failed_refit_is_raised_and_the_next_one_recovers(fail_at):
    programs = SyntheticPrograms(TINY_MOE, limit=120, fail_at=fail_at)
    with ProcessWorkerGroup(2, 2, programs, framework="numpy") as group:
        sync = refit.WeightSynchronizer({"bucket_bytes": "4MiB", "timeout_s": 30}, group)
        assert verify(sync.sync_weights().results, 2) == []
        with pytest.raises(refit.RefitError) as err:
            sync.sync_weights()
        role, rank, _ = fail_at
        side = "source" if role == "policy" else "destination"
        assert f"{side} rank {rank}" in str(err.value)
        assert sync.stale and not sync.ready
        # The next refit prepares again (the failed workers replace their engines) and succeeds.
        report = sync.sync_weights()
        assert verify(report.results, 2) == [] and not sync.stale


def test_a_destination_reporting_false_fails_the_refit():
    class FalseGroup:
        train_world_size = 1
        rollout_world_size = 1

        def total_memory_bytes(self, device):
            return [1 << 34, 1 << 34]

        def create_engines(self, backend, bucket_size_bytes, engine_kwargs):
            assert backend == "nixl" and len(engine_kwargs["session"]) == 16

        def prepare(self):
            return [b"a", b"b"]

        def init_process_groups(self, metadata):
            pass

        def refit(self, index):
            return [None, False]

        def finalize(self):
            pass

    sync = refit.WeightSynchronizer(None, FalseGroup())
    with pytest.raises(refit.RefitError, match="Weight transfer failed during nixl checkpoint-engine sync."):
        sync.sync_weights()
    assert sync.stale
    assert sync.bucket_size.bytes == int((1 << 34) * 0.05) // MiB * MiB


def test_bucket_sizing_errors_come_before_any_engine():
    class TinyGroup:
        train_world_size = 1
        rollout_world_size = 1

        def total_memory_bytes(self, device):
            return [10 * MiB]

        def create_engines(self, *args):
            raise AssertionError("must not be reached")

    sync = refit.WeightSynchronizer({"update_weights_bucket_memory_ratio": 0.05}, TinyGroup())
    with pytest.raises(refit.ConfigError, match="Checkpoint-engine bucket sizing produced less than 1 MiB per buffer"):
        sync.sync_weights()
