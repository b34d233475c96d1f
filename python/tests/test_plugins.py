"""create_checkpoint_engine("module:ClassName", ...): loading plugins, the errors of a backend that
cannot be loaded, the reference's V28 check, and a refit through a plugin built on refit's ABC."""

from __future__ import annotations

import asyncio
import threading

import ml_dtypes
import numpy as np
import pytest

import refit
from plugin_engines import LoopbackEngine, ShardedLoopbackEngine

from helpers import Pair


def test_refits_engine_is_a_checkpoint_engine_base():
    assert issubclass(refit.CheckpointEngine, refit.CheckpointEngineBase)
    pair = Pair(1 << 20)
    try:
        assert isinstance(pair.source, refit.CheckpointEngineBase)
    finally:
        pair.close()


def test_plugin_is_constructed_like_the_reference():
    backend = "plugin_engines:LoopbackEngine"
    engine = refit.create_checkpoint_engine(backend, 123, {backend: {"release_after_refit": True, "color": 1}},
                                            shape="x")
    assert type(engine) is LoopbackEngine
    assert engine.bucket_size == 123 and engine.release_after_refit
    assert engine.extra == {"color": 1, "shape": "x"}
    flat = refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", 7, {"release_after_refit": False})
    assert flat.bucket_size == 7 and not flat.release_after_refit and flat.extra == {}


@pytest.mark.parametrize("backend, message", [
    ("refit_no_such_module:Engine", r"checkpoint-engine backend 'refit_no_such_module:Engine': cannot import module "
                                    r"'refit_no_such_module'"),
    ("plugin_engines:NoSuchEngine", r"backend 'plugin_engines:NoSuchEngine': module 'plugin_engines' has no attribute "
                                    r"'NoSuchEngine'"),
    ("plugin_engines:NotAnEngine", r"backend 'plugin_engines:NotAnEngine': 'NotAnEngine' is class "
                                   r"plugin_engines.NotAnEngine, which does not derive from "
                                   r"refit.CheckpointEngineBase; plugins must subclass it"),
    ("collections:OrderedDict", r"'OrderedDict' is class collections.OrderedDict, which does not derive from "
                                r"refit.CheckpointEngineBase"),
    ("plugin_engines:not_a_class", r"'not_a_class' is a int, which does not derive"),
    ("plugin_engines:IncompleteEngine", r"backend 'plugin_engines:IncompleteEngine': IncompleteEngine does not "
                                        r"implement finalize, init_policy_process_group, init_rollout_process_group, "
                                        r"receive_weight_batches, send_weights"),
    (":Engine", r"backend ':Engine': expected 'module:ClassName' with both parts non-empty"),
    ("plugin_engines:", r"backend 'plugin_engines:': expected 'module:ClassName'"),
])
def test_a_backend_that_cannot_be_loaded_is_a_config_error(backend, message):
    with pytest.raises(refit.ConfigError, match=message):
        refit.create_checkpoint_engine(backend, 1024, {})


def test_an_import_error_is_the_config_errors_cause():
    with pytest.raises(refit.ConfigError) as info:
        refit.create_checkpoint_engine("refit_no_such_module.sub:Engine", 1024)
    assert isinstance(info.value.__cause__, ImportError)


def test_sharded_experts_need_get_target_weight_layout():  # the reference's V28
    with pytest.raises(NotImplementedError, match=r"^LoopbackEngine must override get_target_weight_layout\(\) to "
                                                  r"run with shard_expert_weights=True"):
        refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", 1024, {"shard_expert_weights": True})
    with pytest.raises(NotImplementedError, match="LoopbackEngine must override"):
        refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", 1024,
                                       {"plugin_engines:LoopbackEngine": {"shard_expert_weights": True}})
    sharded = refit.create_checkpoint_engine("plugin_engines:ShardedLoopbackEngine", 1024,
                                             {"shard_expert_weights": True})
    assert type(sharded) is ShardedLoopbackEngine and sharded.get_target_weight_layout() == {"sharded": True}
    plain = refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", 1024, {"shard_expert_weights": False})
    assert plain.get_target_weight_layout() is None


def weights(seed):
    rng = np.random.default_rng(seed)
    return [("a", rng.standard_normal(300, dtype=np.float32)),
            ("b", rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16)),
            ("c", rng.integers(0, 9, 3).astype(np.int8)),
            ("d", rng.standard_normal(1000).astype(np.float16))]


def connected(bucket_size):
    source = refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", bucket_size, {})
    destination = refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", bucket_size, {})
    md = [source.prepare(), destination.prepare()]
    source.init_policy_process_group(0, 1, 1, md)
    destination.init_rollout_process_group(0, 1, 1, md)
    return source, destination


def check(sent, got):
    assert [n for n, _ in sent] == [n for n, _ in got]
    for (name, t), (_, r) in zip(sent, got):
        assert r.dtype == t.dtype and r.shape == t.shape and r.tobytes() == t.tobytes(), name


def test_a_refit_through_a_plugin_with_the_base_class_defaults():
    source, destination = connected(256)
    sent = weights(1)
    stats = {}
    sender = threading.Thread(target=lambda: stats.update(source.send_weights(sent)))
    sender.start()
    got = []
    destination.receive_weights(lambda batch: got.extend((n, np.array(t)) for n, t in batch))
    sender.join(30)
    assert stats["buckets"] > 4  # "a" alone spans 5 buckets
    check(sent, got)


def test_async_forms_of_a_plugin():
    source, destination = connected(100)
    sent = weights(2)

    async def main():
        async def consume():
            got = []
            async with destination.receive_weight_batches_async() as batches:
                async for batch in batches:
                    got.extend((n, np.array(t)) for n, t in batch)
            return got
        stats, got = await asyncio.gather(source.send_weights_async(sent), consume())
        return stats, got

    stats, got = asyncio.run(main())
    assert stats["buckets"] > 10
    check(sent, got)


# ---- the plugin transport in the configuration, driven by refit.WeightSynchronizer ---------------

class NumberedSource:
    def weights(self, index):
        return [("a", np.full(1000, index, np.float32)), ("b", np.arange(3000, dtype=np.float32) + index)]


class Keeper:
    def __init__(self):
        self.got = {}

    def load(self, index, batch):
        self.got.update((name, np.array(t, copy=True)) for name, t in batch)


def test_the_synchronizer_creates_the_plugin_the_configuration_names_with_its_scope():
    from helpers import ThreadWorkerGroup

    config = {"refit_transport": "plugin_engines:LoopbackEngine",
              "refit_cfg": {"plugin_engines:LoopbackEngine": {"update_weights_bucket_memory_ratio": 0.6,
                                                              "rails": 8, "name": "fast", "quoted": "true"}}}
    source = refit.EngineWorker("policy", 0, NumberedSource())
    destination = refit.EngineWorker("rollout", 0, Keeper(), framework="numpy")
    group = ThreadWorkerGroup([source, destination])
    try:
        sync = refit.WeightSynchronizer(config, group)
        assert sync.backend == "plugin_engines:LoopbackEngine"
        for index in (0, 1):  # the driver's refit index
            sync.sync_weights()
            got = destination.program.got
            assert np.array_equal(got["a"], np.full(1000, index, np.float32))
            assert np.array_equal(got["b"], np.arange(3000, dtype=np.float32) + index)
        for worker in (source, destination):
            assert isinstance(worker.engine, LoopbackEngine)
            # The scope's keys, typed as YAML read them; the session and fingerprint are not the plugin's.
            assert worker.engine.extra == {"rails": 8, "name": "fast", "quoted": "true"}
            assert worker.engine.release_after_refit is False
        # A plugin's ratio may exceed the two-buffer bound of nixl's: 0.6 of the smallest memory.
        memory = refit.total_device_memory_bytes("cpu")
        assert sync.bucket_size.bytes == (int(memory * 0.6) >> 20) << 20
    finally:
        group.close()


def test_a_backend_that_contradicts_the_configured_plugin_is_refused():
    config = {"refit_transport": "plugin_engines:LoopbackEngine", "refit_cfg": {"plugin_engines:LoopbackEngine": {}}}
    with pytest.raises(refit.ConfigError, match="backend 'nixl' contradicts refit_transport 'plugin_engines:Loop"):
        refit.WeightSynchronizer(config, object(), backend="nixl")
    with pytest.raises(refit.ConfigError, match=r"needs its scope refit_cfg\['m:C'\]"):
        refit.as_config({"refit_transport": "m:C"})
