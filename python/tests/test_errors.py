"""C++ errors arrive as Python exceptions of their kind, with the C++ message unchanged."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import re
import signal
import time

import numpy as np
import pytest

import refit

from helpers import Pair

MiB = 1 << 20


def test_bad_config_raises_config_error_with_the_cpp_message():
    with pytest.raises(refit.ConfigError) as err:
        refit.parse_config("", ["device=gpu"])
    # The message of refit::parse_device (src/core/config.cpp), unchanged.
    assert str(err.value) == "refit_cfg.nixl.device must be cpu, cuda or cuda:N (N >= 0), got 'gpu'"
    assert err.value.kind == "config"
    assert isinstance(err.value, ValueError) and isinstance(err.value, refit.RefitError)

    with pytest.raises(refit.ConfigError, match=re.escape(
            "refit_cfg.nixl.update_weights_bucket_memory_ratio must be > 0 and < 0.5")):
        refit.create_checkpoint_engine("nixl", MiB, {"update_weights_bucket_memory_ratio": 0.7})
    with pytest.raises(refit.ConfigError, match="unknown key refit_cfg.nixl.bucket_size"):
        refit.as_config({"bucket_size": 5})


def test_an_unknown_engine_kwargs_key_is_named_with_the_config_keys_and_the_engine_options():
    from refit.engine import CONFIG_KEYS, ENGINE_KEYS
    for engine_kwargs, extra in (({"bucket_size": 5}, {}), ({"nixl": {"bucket_size": 5}}, {}),
                                 ({"session": refit.new_session_id(), "bucket_size": 5}, {}),
                                 (None, {"bucket_size": 5})):
        with pytest.raises(refit.ConfigError) as err:
            refit.create_checkpoint_engine("nixl", MiB, engine_kwargs, **extra)
        message = str(err.value)
        assert message.startswith("engine_kwargs: unknown key(s) bucket_size: expected configuration keys"), message
        for key in CONFIG_KEYS + ENGINE_KEYS:
            assert key in message, (key, message)


def test_every_kind_has_its_class():
    kinds = {
        refit.ConfigError: "config", refit.InvalidArgumentError: "invalid_argument", refit.ModelError: "model",
        refit.TopologyError: "topology", refit.LayoutError: "layout", refit.TransportError: "transport",
        refit.RefitTimeoutError: "timeout", refit.PeerLostError: "peer_lost", refit.IntegrityError: "integrity",
        refit.ProtocolError: "protocol", refit.RefitIOError: "io", refit.UnsupportedError: "unsupported",
        refit.InternalError: "internal",
    }
    for cls, kind in kinds.items():
        assert issubclass(cls, refit.RefitError) and cls.kind == kind
        e = pickle.loads(pickle.dumps(cls("a message")))  # crosses process boundaries (multiprocessing, Ray)
        assert type(e) is cls and str(e) == "a message"
    assert issubclass(refit.RefitTimeoutError, TimeoutError)
    assert issubclass(refit.PeerLostError, ConnectionError)


def test_model_and_topology_errors():
    with pytest.raises(refit.ModelError, match="no-such-model"):
        refit.load_model_inventory("/no-such-model/config.json")
    with pytest.raises(refit.TopologyError, match=re.escape("rollout_rank must be in [0, 2), got 2")):
        refit.source_rank_for_destination(2, 2, 2)


def test_a_failing_weight_iterator_fails_both_sides_with_its_cause():
    pair = Pair(MiB)
    try:
        def weights():
            yield "a", np.ones(1000, np.float32)
            raise ZeroDivisionError("the policy crashed")

        sender = pair.start_send(weights())
        start = time.monotonic()
        with pytest.raises(refit.RefitError) as received:
            for _ in pair.destination.receive_weight_batches():
                pass
        with pytest.raises(refit.InvalidArgumentError) as sent:
            sender.join()
        assert time.monotonic() - start < 5  # the source's abort reaches the destination at once
        assert "the weight iterator raised ZeroDivisionError: the policy crashed" in str(sent.value)
        assert str(sent.value).startswith("source rank 0, refit 1 of this connection, phase pack bucket 0")
        assert isinstance(sent.value.__cause__, ZeroDivisionError)
        assert "source rank 0" in str(received.value)
        assert pair.destination.stale
    finally:
        pair.close()


@pytest.mark.parametrize("item,message", [
    (("w", np.zeros(4, np.uint16)), "tensor 'w' has dtype uint16, which refit does not move"),
    (("w", "not a tensor"), "tensor 'w': cannot read a str as a tensor"),
    (("w",), "item 0 of the weight iterator is a tuple, expected a (name, tensor) pair"),
    ((7, np.zeros(4)), "item 0 of the weight iterator: the name must be a str, got int"),
])
def test_bad_items_name_the_tensor(item, message):
    pair = Pair(MiB)
    try:
        sender = pair.start_send([item])
        with pytest.raises(refit.RefitError):
            for _ in pair.destination.receive_weight_batches():
                pass
        with pytest.raises(refit.RefitError) as err:
            sender.join()
        assert message in str(err.value)
    finally:
        pair.close()


def test_a_repeated_name_is_refused():
    pair = Pair(MiB)
    try:
        sender = pair.start_send([("w", np.zeros(4)), ("w", np.zeros(4))])
        with pytest.raises(refit.RefitError):
            for _ in pair.destination.receive_weight_batches():
                pass
        with pytest.raises(refit.InvalidArgumentError, match="tensor 'w' appears twice in one refit"):
            sender.join()
    finally:
        pair.close()


def _killed_destination(conn, session: bytes) -> None:
    engine = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 60, "session": session, "framework": "numpy"})
    conn.send(engine.prepare())
    engine.init_rollout_process_group(0, 1, 1, conn.recv())
    for batch in engine.receive_weight_batches():
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the first batch


@contextlib.contextmanager
def _peer_process(target):
    """`target(conn, session)` in a spawned process: yields (conn, session, process), joined on leaving."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    session = refit.new_session_id()
    proc = ctx.Process(target=target, args=(child, session), daemon=True)
    proc.start()
    try:
        yield parent, session, proc
    finally:
        proc.join(10)


@contextlib.contextmanager
def _source_of(peer):
    """A source engine connected to the destination `_peer_process` runs (timeout_s = 60); closed on leaving."""
    conn, session, _ = peer
    source = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 60, "session": session})
    try:
        md = [source.prepare(), conn.recv()]
        conn.send(md)
        source.init_policy_process_group(0, 1, 1, md)
        yield source
    finally:
        source.close()


def test_a_killed_peer_surfaces_as_peer_lost_error_with_the_cpp_message():
    with _peer_process(_killed_destination) as peer, _source_of(peer) as source:
        weights = [(f"w{i}", np.full(MiB // 4, i, np.float32)) for i in range(8)]
        start = time.monotonic()
        with pytest.raises(refit.PeerLostError) as err:
            source.send_weights(weights)
        assert time.monotonic() - start < 20
        # The C++ engine's message: who failed, where, and which peer died.
        assert re.fullmatch(
            rf"source rank 0, refit 1 of this connection, phase wait for destination rank 0 to read bucket \d+: "
            rf"lost destination rank 0: its process \(pid {peer[2].pid}\) is gone", str(err.value)), str(err.value)
    assert peer[2].exitcode == -signal.SIGKILL


def _finalizing_destination(conn, session: bytes) -> None:
    engine = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 60, "session": session, "framework": "numpy"})
    conn.send(engine.prepare())
    engine.init_rollout_process_group(0, 1, 1, conn.recv())
    for _ in engine.receive_weight_batches():
        pass
    engine.finalize()  # leaves the connection, and stays alive until told
    conn.send("finalized")
    conn.recv()
    engine.close()


def test_a_destination_that_finalizes_fails_its_sources_next_send_at_once():
    # Two processes over UCX; the source waits with timeout_s = 60 and must hear of the finalize now.
    with _peer_process(_finalizing_destination) as peer, _source_of(peer) as source:
        conn = peer[0]
        weights = [(f"w{i}", np.full(MiB // 4, i, np.float32)) for i in range(8)]
        source.send_weights(weights)
        assert conn.recv() == "finalized"
        start = time.monotonic()
        with pytest.raises(refit.PeerLostError) as err:
            source.send_weights(weights)
        assert time.monotonic() - start < 10, "the source waited for its deadline"
        assert "destination rank 0 left this connection" in str(err.value), str(err.value)
        assert "it called finalize()" in str(err.value), str(err.value)
        conn.send("exit")
    assert peer[2].exitcode == 0


def _source_that_exits_after_the_exchange(conn, session: bytes) -> None:
    engine = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 60, "session": session})
    conn.send(engine.prepare())
    conn.recv()
    os._exit(0)


def test_a_source_gone_before_its_destination_connects_is_named_lost_not_a_transport_error():
    # UCX says only "Shared memory error" when it cannot attach to a dead peer's memory.
    with _peer_process(_source_that_exits_after_the_exchange) as (conn, session, proc):
        destination = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 60, "session": session,
                                                                   "framework": "numpy"})
        try:
            md = [conn.recv(), destination.prepare()]
            conn.send(md)
            proc.join(10)
            with pytest.raises(refit.PeerLostError) as err:
                destination.init_rollout_process_group(0, 1, 1, md)  # shared memory: attaching fails
                for _ in destination.receive_weight_batches():  # a transport that connects lazily
                    pass
            assert f"lost source rank 0: its process (pid {proc.pid}) is gone" in str(err.value), str(err.value)
        finally:
            destination.close()
