"""The engine API's lifecycle, between two processes over UCX and within one process."""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

import refit

from helpers import Pair, config, source_with_destination_process

MiB = 1 << 20


def make_weights(seed: int):
    rng = np.random.default_rng(seed)
    return [
        ("model.embed_tokens.weight", rng.standard_normal((700, 1024), dtype=np.float32)),  # 2.7 MiB: split
        ("model.norm.weight", rng.standard_normal(1024).astype(ml_dtypes.bfloat16)),
        ("model.layers.0.mask", rng.integers(0, 2, (13, 7)).astype(np.bool_)),
        ("model.layers.0.empty", np.zeros((0, 5), np.float16)),  # zero bytes: still delivered
        ("model.layers.0.scalar", np.array(3.5, np.float64)),
        ("model.layers.0.ids", rng.integers(-(1 << 40), 1 << 40, 333, dtype=np.int64)),
        ("model.layers.0.strided", rng.standard_normal((64, 64)).astype(np.float16)[:, ::2]),  # made contiguous
        ("model.layers.0.i8", rng.integers(-128, 127, 4096, dtype=np.int8)),
        ("model.layers.0.fp8", rng.standard_normal(100).astype(ml_dtypes.float8_e4m3fn)),
    ]


def expected(weights):
    return {name: (refit.xxh3_64(np.ascontiguousarray(t)), t.dtype.name, t.shape) for name, t in weights}


def test_lifecycle_between_two_processes():
    # The metadata crosses by pickle, as it does between Ray actors.
    with source_with_destination_process(config(timeout_s=60), refits=2) as (source, destination):
        assert source.get_target_weight_layout() is None
        for seed in (1, 2):
            weights = make_weights(seed)
            stats = source.send_weights(weights)
            assert stats["tensors"] == len(weights) and stats["had_peer"]
            kind, got, rstats, stale = destination.recv()
            assert kind == "refit", got
            assert not stale
            assert got == expected(weights)
            assert rstats["tensors"] == len(weights)
            assert rstats["payload_bytes"] == sum(np.asarray(t).nbytes for _, t in weights)


def test_release_after_refit_prepares_again():
    pair = Pair(MiB, config(release_after_refit=True))
    try:
        for seed in (1, 2):
            weights = make_weights(seed)
            got = {}
            pair.refit(weights, lambda b: got.update({n: refit.xxh3_64(t) for n, t in b}))
            assert got == {n: h for n, (h, _, _) in expected(weights).items()}
            pair.source.finalize()
            pair.destination.finalize()
            with pytest.raises(refit.InvalidArgumentError, match="prepare"):
                pair.source.init_policy_process_group(0, 1, 1, [b"", b""])
            pair.connect()  # buffers were freed: prepare + a fresh metadata exchange
    finally:
        pair.close()


def test_source_without_destination_drains_its_weights():
    session = refit.new_session_id()
    cfg = config()
    engines = [refit.CheckpointEngine(MiB, cfg, session=session) for _ in range(3)]  # 2 sources, 1 destination
    try:
        md = [e.prepare() for e in engines]
        engines[0].init_policy_process_group(0, 2, 1, md)
        engines[1].init_policy_process_group(1, 2, 1, md)
        engines[2].init_rollout_process_group(0, 2, 1, md)
        pulled = []

        def stream():
            for name, t in make_weights(3):
                pulled.append(name)
                yield name, t

        stats = engines[1].send_weights(stream())
        assert not stats["had_peer"] and len(pulled) == len(make_weights(3))
    finally:
        for e in engines:
            e.close()


def test_a_source_that_is_not_connected_refuses_to_send():
    # Before init, or after finalize(), a send would drain the stream and deliver nothing.
    pair = Pair(MiB, config())
    lone = refit.CheckpointEngine(MiB, config())
    try:
        lone.prepare()
        with pytest.raises(refit.TopologyError, match="before the source was connected"):
            lone.send_weights(make_weights(2))
        pair.refit(make_weights(2))
        pair.source.finalize()
        with pytest.raises(refit.TopologyError, match="after finalize"):
            pair.source.send_weights(make_weights(2))
    finally:
        lone.close()
        pair.close()


def test_topology_and_session_are_checked():
    session = refit.new_session_id()
    a = refit.CheckpointEngine(MiB, config(), session=session)
    b = refit.CheckpointEngine(MiB, config(), session=refit.new_session_id())
    try:
        md = [a.prepare(), b.prepare()]
        with pytest.raises(refit.TopologyError, match="paired refit needs train_world_size >= rollout_world_size"):
            a.init_policy_process_group(0, 1, 2, md + [md[1]])
        with pytest.raises(refit.ProtocolError, match="another refit session"):
            a.init_policy_process_group(0, 1, 1, md)
        with pytest.raises(refit.TopologyError):
            refit.source_rank_for_destination(3, 2, 2)
    finally:
        a.close()
        b.close()


def test_receive_before_init_raises_the_reference_error_kind():
    e = refit.CheckpointEngine(MiB, config())
    try:
        e.prepare()
        with pytest.raises(refit.TopologyError, match="not connected to a source"):
            for _ in e.receive_weight_batches():
                pass
    finally:
        e.close()


def test_create_checkpoint_engine_shapes_of_engine_kwargs():
    e1 = refit.create_checkpoint_engine("nixl", 4 * MiB, {"device": "cpu", "timeout_s": 7})
    e2 = refit.create_checkpoint_engine("nixl", 4 * MiB, {"nixl": {"backend_init_params": {"ucx_error_handling_mode": "peer"}}})
    e3 = refit.create_checkpoint_engine("nixl", 4 * MiB, refit.parse_config("", ["timeout_s=9"]), framework="numpy")
    try:
        assert e1.config.timeout_s == 7 and e1.bucket_size == 4 * MiB
        assert e2.config.backend_init_params == {"ucx_error_handling_mode": "peer"}
        assert e3.config.timeout_s == 9
    finally:
        for e in (e1, e2, e3):
            e.close()
    with pytest.raises(refit.ConfigError, match="Unknown checkpoint-engine backend 'nccl'"):
        refit.create_checkpoint_engine("nccl", MiB, {})


def test_plugin_backend_is_constructed_like_the_reference():  # more in test_plugins.py
    engine = refit.create_checkpoint_engine("plugin_engines:LoopbackEngine", 123, {"release_after_refit": True})
    assert (engine.bucket_size, engine.release_after_refit, engine.extra) == (123, True, {})
    with pytest.raises(refit.ConfigError, match="does not derive from refit.CheckpointEngineBase"):
        refit.create_checkpoint_engine("collections:OrderedDict", 123, {"release_after_refit": True})


def test_lifecycle_misuse_is_reported():
    pair = Pair(MiB)
    try:
        it = pair.destination.receive_weight_batches()
        sender = pair.start_send(make_weights(5))
        first = next(it)
        assert first
        with pytest.raises(refit.InvalidArgumentError, match="still running"):
            pair.destination.prepare()
        for _ in it:
            pass
        sender.join()
        pair.destination.prepare()  # fine once the iteration ended
    finally:
        pair.close()
    with pytest.raises(refit.InvalidArgumentError, match="closed"):
        pair.destination.prepare()


@pytest.mark.parametrize("in_place", [False, True])
def test_in_place_keeps_every_tensor_until_the_send_returns(in_place):
    """in_place=True: the source keeps every tensor alive for the whole send (a destination may
    load from them); otherwise each goes once the next is pulled. Over UCX nothing maps Python's
    memory, so the bytes still travel in buckets either way."""
    import weakref

    alive = []

    def weights():
        for i in range(40):
            tensor = np.full(4096, i, np.float32)
            alive.append(weakref.ref(tensor))
            yield f"w{i}", tensor

    pair = Pair(64 * 1024)
    dead_at_last_batch = []
    try:
        got = {}

        def load(batch):
            got.update({n: np.array(t) for n, t in batch})
            if len(got) == 40:
                dead_at_last_batch.append(sum(ref() is None for ref in alive))

        sender = pair.start_send(weights(), in_place=in_place)
        pair.destination.receive_weights(load)
        stats = sender.join()
        assert all(np.array_equal(got[f"w{i}"], np.full(4096, i, np.float32)) for i in range(40))
        assert stats["in_place_bytes"] == 0 and stats["payload_bytes"] == 40 * 4096 * 4
        if in_place:
            assert dead_at_last_batch == [0]
        else:
            assert dead_at_last_batch[0] >= 38, dead_at_last_batch
        assert all(ref() is None for ref in alive)  # all released once the send returned
    finally:
        pair.close()


def test_one_send_at_a_time_and_no_close_while_it_runs():
    """A second send_weights() on one engine from another thread would interleave its buckets with
    the first's on the same link (a destination took one send's bytes under the other's names and
    reported success): refused, as are close(), finalize() and prepare() while a send runs."""
    import threading
    import time

    pair = Pair(4096)
    gate = threading.Event()

    def slow():
        for i in range(8):
            if i == 2:
                gate.set()
                time.sleep(0.3)  # the other calls come now
            yield f"w{i}", np.full(1024, i, np.float32)

    try:
        sender = pair.start_send(slow())
        it = pair.destination.receive_weight_batches()
        got = {}
        receiver = threading.Thread(target=lambda: got.update({n: np.array(t) for b in it for n, t in b}))
        receiver.start()
        assert gate.wait(10)
        for call in (lambda: pair.source.send_weights([("x", np.zeros(4, np.float32))]), pair.source.close,
                     pair.source.finalize, pair.source.prepare):
            with pytest.raises(refit.InvalidArgumentError, match="send_weights\\(\\) is running on this engine"):
                call()
        sender.join()
        receiver.join(30)
        assert sorted(got) == [f"w{i}" for i in range(8)]
        assert all(np.array_equal(got[f"w{i}"], np.full(1024, i, np.float32)) for i in range(8))
    finally:
        pair.close()


def test_torch_tensors_with_a_lazy_negation_go_as_the_values_they_read_as():
    """torch's negative and conjugate bits (``.conj().imag``, ``torch._neg_view``) leave memory that
    holds other values than the tensor reads as, and DLPack exports that memory: a source sends the
    values (a copy), an in-place send and a parameter refuse such a tensor."""
    torch = pytest.importorskip("torch")
    a = torch.tensor([[3 + 4j]], dtype=torch.complex64).conj().imag  # reads -4, memory holds 4
    b = torch._neg_view(torch.tensor([1.0, 2.0, 3.0]))
    assert a.is_neg() and b.is_neg() and a.is_contiguous()
    pair = Pair(4096)
    try:
        got = {}
        pair.refit([("a", a), ("b", b)], load=lambda batch: got.update({n: np.array(t) for n, t in batch}))
        assert got["a"].tolist() == [[-4.0]] and got["b"].tolist() == [-1.0, -2.0, -3.0]
        with pytest.raises(refit.InvalidArgumentError, match="negative bit"):
            refit.TensorSet([("b", b)])
        with pytest.raises(refit.InvalidArgumentError, match="negative bit"):
            refit.ParameterLoader({"b": torch._neg_view(torch.zeros(3))})
    finally:
        pair.close()
