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


def test_loading_destinations_copy_into_their_parameters_and_hash_them_after():
    """SyntheticPrograms(destination="load"): what refit bench's destinations do (bench_python.py
    compares against it): every tensor copied into the destination's own parameters, each refit's
    content checked bitwise against its source's, and a refit's new content seen in the next."""
    with ProcessWorkerGroup(1, 1, SyntheticPrograms(TINY_MOE, limit=40, destination="load"),
                            framework="numpy") as group:
        sync = refit.WeightSynchronizer({"timeout_s": 60}, group, model_bytes=64 * MiB)
        hashes = []
        for _ in range(2):
            report = sync.sync_weights()
            assert verify(report.results, 1) == []
            hashes.append(report.destination_results[0]["report"]["hashes"])
            assert len(hashes[-1]) == 40
        assert hashes[0] != hashes[1], "the parameters hold each refit's content"
    with pytest.raises(refit.InvalidArgumentError, match="destination='nowhere'"):
        SyntheticPrograms(TINY_MOE, destination="nowhere")


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


class ScriptedGroup:
    """A group whose calls succeed unless told otherwise; records them."""

    train_world_size = 1
    rollout_world_size = 1

    def __init__(self):
        self.calls = []
        self.raise_in = {}  # call name -> exception to raise (once)
        self.metadata = [b"a", b"b"]

    def _step(self, name):
        self.calls.append(name)
        error = self.raise_in.pop(name, None)
        if error is not None:
            raise error

    def total_memory_bytes(self, device):
        self._step("total_memory_bytes")
        return [1 << 34, 1 << 34]

    def create_engines(self, backend, bucket_size_bytes, engine_kwargs):
        self._step("create_engines")

    def prepare(self):
        self._step("prepare")
        return self.metadata

    def init_process_groups(self, metadata):
        self._step("init_process_groups")

    def refit(self, index):
        self._step("refit")
        return [None, True]

    def finalize(self):
        self._step("finalize")


def test_the_groups_own_exception_is_raised_as_itself():
    class LostHost(Exception):
        pass

    group = ScriptedGroup()
    sync = refit.WeightSynchronizer(None, group)
    sync.sync_weights()
    error = LostHost("destination rank 0 on host h4 is gone")
    error.add_note("also source rank 0 failed")
    group.raise_in["refit"] = error
    with pytest.raises(LostHost) as raised:
        sync.sync_weights()
    assert raised.value is error and raised.value.__notes__ == ["also source rank 0 failed"]
    assert sync.stale and not sync.ready
    # It shut down at once; the next sync creates engines again and prepares.
    sync.sync_weights()
    assert group.calls == ["total_memory_bytes", "create_engines", "prepare", "init_process_groups", "refit",
                           "refit", "finalize", "create_engines", "prepare", "init_process_groups", "refit"]
    assert not sync.stale


def test_a_failing_shutdown_after_a_failed_refit_is_only_logged():
    group = ScriptedGroup()
    sync = refit.WeightSynchronizer({"release_after_refit": True}, group)
    group.raise_in["refit"] = refit.PeerLostError("destination rank 0 was killed")
    group.raise_in["finalize"] = KeyError("finalize broke")
    with pytest.raises(refit.PeerLostError, match="destination rank 0 was killed"):
        sync.sync_weights()
    assert group.calls[-2:] == ["refit", "finalize"] and not sync.ready
    # With release_after_refit, a failing finalize after a good refit is logged too.
    group.raise_in["finalize"] = RuntimeError("finalize broke again")
    report = sync.sync_weights()
    assert report.destination_results == [True] and not sync.stale and not sync.ready


def test_metadata_that_do_not_number_the_workers_are_a_topology_error():
    group = ScriptedGroup()
    group.metadata = [b"a"]
    sync = refit.WeightSynchronizer(None, group)
    with pytest.raises(refit.TopologyError, match="returned 1 metadata entries for train_world_size=1 \\+ "
                                                   "rollout_world_size=1"):
        sync.ensure_ready()
    assert not sync.ready
    group.metadata = [b"a", b"b"]
    sync.ensure_ready()
    assert sync.ready and sync.stale


def test_the_groups_last_refit_seconds_is_the_reports():
    group = ScriptedGroup()
    group.last_refit_seconds = 12.5
    sync = refit.WeightSynchronizer(None, group)
    assert sync.sync_weights().seconds == 12.5
    del group.last_refit_seconds
    assert 0 < sync.sync_weights().seconds < 12.5


class WeightsFailAt:
    """Sources whose weights(index) raises at refit 1, before anything is sent."""

    def __init__(self, role: str, rank: int):
        from refit.testing import HashingDestination, SyntheticSource
        self.inner = SyntheticSource(TINY_MOE, limit=20) if role == "policy" else HashingDestination()
        self.role = role

    def stage(self, index: int) -> None:
        self.inner.stage(index) if hasattr(self.inner, "stage") else None

    def weights(self, index: int):
        if index == 1:
            raise ValueError("the trainer's checkpoint is not ready")
        return self.inner.weights(index)

    def load(self, index: int, batch) -> None:
        self.inner.load(index, batch)

    def report(self, index: int):
        return self.inner.report(index)


def test_a_source_that_fails_before_sending_ends_its_destinations_refit_at_once():
    import time

    with ProcessWorkerGroup(1, 1, WeightsFailAt, framework="numpy") as group:
        sync = refit.WeightSynchronizer({"bucket_bytes": "4MiB", "timeout_s": 60}, group)
        sync.sync_weights()
        start = time.monotonic()
        with pytest.raises(ValueError, match="the trainer's checkpoint is not ready") as err:
            sync.sync_weights()
        assert time.monotonic() - start < 10  # not the destination's 60 s timeout
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert "destination rank 0 failed" in notes and "checkpoint is not ready" in notes
