"""backend_name NIXL: refit's engine over a NIXL agent (refit.nixl), between real processes.

Skipped with a message where NIXL's Python package (nixl-cu12 / nixl-cu13) is not installed;
scripts/test_python.sh installs it. The error for a missing NIXL is tested everywhere."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import refit
import refit.nixl

from helpers import Pair, config, nixl_region_process, source_with_destination_process
from test_engine import expected, make_weights

MiB = 1 << 20
NIXL_MISSING = refit.nixl.nixl_available()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL is not installed: {NIXL_MISSING}")


def nixl_config(**overrides):
    return config(backend_name="NIXL", **overrides)


def test_asking_for_nixl_without_it_says_what_to_install(monkeypatch):
    monkeypatch.setattr(refit.nixl, "NIXL_MODULES", ("refit_test_no_such_nixl",))
    with pytest.raises(refit.UnsupportedError, match=r"backend_name NIXL needs NIXL's Python package.*"
                                                     r"pip install nixl-cu12"):
        refit.CheckpointEngine(MiB, nixl_config())
    # The package itself works without NIXL.
    pair = Pair(MiB)
    try:
        stats, _ = pair.refit([("w", np.arange(10.0))])
        assert stats["tensors"] == 1
    finally:
        pair.close()


@needs_nixl
def test_refits_between_two_processes_bitwise():
    with source_with_destination_process(nixl_config(timeout_s=60, verify_checksums=True), refits=2) as (source, dst):
        assert source.transport_name == "NIXL"
        for seed in (1, 2):
            weights = make_weights(seed)  # a tensor split over three buckets, a zero-byte one, odd dtypes
            stats = source.send_weights(weights)
            assert stats["tensors"] == len(weights) and stats["buckets"] >= 3
            kind, got, rstats, stale = dst.recv()
            assert kind == "refit", got
            assert got == expected(weights) and not stale
            assert rstats["route"] == "NIXL UCX"
            assert rstats["wire_bytes"] >= rstats["payload_bytes"] == sum(np.asarray(t).nbytes for _, t in weights)


@needs_nixl
def test_large_tensors_are_read_from_the_sources_own_memory():
    # With read_source_memory and in_place=True the source's tensors stay put during the send, so
    # the destination READs the large ones (>= 64 KiB) straight from them over NIXL; the source
    # packs only the small ones.
    rng = np.random.default_rng(5)
    weights = [("embed", rng.standard_normal((512, 256), dtype=np.float32)),  # 512 KiB
               ("norm", rng.standard_normal(16).astype(np.float16)),
               ("qkv", rng.standard_normal((768, 512), dtype=np.float32)),  # 1.5 MiB: two buckets
               ("empty", np.zeros((0, 3), np.float32)),
               ("head", rng.integers(0, 255, 100_003, dtype=np.uint8))]
    large = sum(t.nbytes for _, t in weights if t.nbytes >= 64 << 10)
    cfg = nixl_config(timeout_s=60, verify_checksums=True, backend_init_params={"read_source_memory": "true"})
    with source_with_destination_process(cfg, refits=3) as (source, dst):
        for refit_number, in_place in enumerate((True, True, False)):
            for _, t in weights:
                t += np.asarray(1, t.dtype)  # training changes the values where they are
            stats = source.send_weights(weights, in_place=in_place)
            kind, got, rstats, stale = dst.recv()
            assert kind == "refit", got
            assert got == expected(weights) and not stale, refit_number
            assert stats["in_place_bytes"] == rstats["in_place_bytes"] == (large if in_place else 0), refit_number


@needs_nixl
def test_backend_init_params_choose_the_plugin_and_reach_it():
    with pytest.raises(refit.ConfigError, match=r"backend_init_params.backend: NIXL has no plugin 'NO_SUCH'.*UCX"):
        refit.CheckpointEngine(MiB, nixl_config(backend_init_params={"backend": "NO_SUCH"}))
    # Values go to create_backend as strings (the reference's str()); here one UCX rejects.
    with pytest.raises(refit.ConfigError, match=r"backend_init_params.read_source_memory: expected true or false"):
        refit.CheckpointEngine(MiB, nixl_config(backend_init_params={"read_source_memory": "maybe"}))
    with pytest.raises(refit.ConfigError, match=r"backend_init_params: NIXL's UCX backend refused"):
        refit.CheckpointEngine(MiB, nixl_config(backend_init_params={"ucx_error_handling_mode": "bogus"}))
    pair = Pair(MiB, nixl_config(backend_init_params={"backend": "UCX", "ucx_error_handling_mode": "peer",
                                                      "num_workers": 2}))
    try:
        weights = make_weights(3)
        got = {}
        pair.refit(weights, load=lambda batch: got.update(
            {n: (refit.xxh3_64(t), t.dtype.name, tuple(t.shape)) for n, t in batch}))
        assert got == expected(weights)
    finally:
        pair.close()


@needs_nixl
def test_every_wait_has_the_deadline():
    pair = Pair(MiB, nixl_config(timeout_s=1.5))
    try:
        start = time.monotonic()
        with pytest.raises(refit.RefitTimeoutError, match="source rank 0"):
            for _ in pair.destination.receive_weight_batches():  # the source never sends
                pass
        assert time.monotonic() - start < 10
        assert pair.destination.stale
    finally:
        pair.close()


def _killed_source(conn, session: bytes) -> None:
    engine = refit.create_checkpoint_engine("nixl", MiB, {"nixl": nixl_config(timeout_s=60), "session": session})
    conn.send(engine.prepare())
    engine.init_policy_process_group(0, 1, 1, conn.recv())

    def weights():
        yield "first", np.full(MiB // 2, 1, np.float32)  # two buckets' worth: the destination starts reading
        yield "second", np.full(MiB // 2, 2, np.float32)
        os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of the refit

    engine.send_weights(weights())


def _connected_to_a_process(target, role: str):
    """Spawns ``target(conn, session)``, the other side of a pair, and returns this process's
    engine (a "source" or a "destination"), connected to it, and the process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    session = refit.new_session_id()
    proc = ctx.Process(target=target, args=(child, session), daemon=True)
    proc.start()
    engine = refit.create_checkpoint_engine("nixl", MiB, {"nixl": nixl_config(timeout_s=60), "session": session,
                                                          "framework": "numpy"})
    md = [engine.prepare(), parent.recv()] if role == "source" else [parent.recv(), engine.prepare()]
    parent.send(md)
    init = engine.init_policy_process_group if role == "source" else engine.init_rollout_process_group
    init(0, 1, 1, md)
    return engine, proc


@needs_nixl
def test_a_killed_source_is_a_lost_peer_for_its_destination():
    destination, proc = _connected_to_a_process(_killed_source, "destination")
    try:
        start = time.monotonic()
        with pytest.raises(refit.PeerLostError, match=r"destination rank 0.*source rank 0") as err:
            for _ in destination.receive_weight_batches():
                pass
        assert time.monotonic() - start < 20, "the loss was found by the deadline, not by liveness"
        assert destination.stale, str(err.value)
    finally:
        destination.close()
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


def _killed_destination(conn, session: bytes) -> None:
    engine = refit.create_checkpoint_engine("nixl", MiB, {"nixl": nixl_config(timeout_s=60), "session": session,
                                                          "framework": "numpy"})
    conn.send(engine.prepare())
    engine.init_rollout_process_group(0, 1, 1, conn.recv())
    for _ in engine.receive_weight_batches():
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the first batch


@needs_nixl
def test_a_killed_destination_is_a_lost_peer_for_its_source():
    source, proc = _connected_to_a_process(_killed_destination, "source")
    try:
        start = time.monotonic()
        with pytest.raises(refit.PeerLostError, match=r"source rank 0.*destination rank 0"):
            source.send_weights([(f"w{i}", np.full(MiB // 4, i, np.float32)) for i in range(8)])
        assert time.monotonic() - start < 20
    finally:
        source.close()
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL


@needs_nixl
def test_reads_messages_bad_metadata_and_a_lost_peer_at_the_transport():
    """The transport object between two processes: bitwise reads, ordered messages, a READ
    outside the peer's registration, a peer's metadata blob that is not one, and a read from a
    peer that exited."""
    from refit.nixl import NixlTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    payload = np.random.default_rng(7).integers(0, 256, 3 * MiB + 5, dtype=np.uint8).tobytes()
    proc = ctx.Process(target=nixl_region_process, args=(child, payload), daemon=True)
    proc.start()
    transport = NixlTransport(refit.as_config({"backend_name": "NIXL"}))
    try:
        address, remote, length, key = parent.recv()
        with pytest.raises(refit.ProtocolError, match=r"source rank 9: its NIXL agent metadata .* could not be loaded"):
            transport.connect(b"\x00not NIXL metadata" * 8, "source rank 9")
        with pytest.raises(refit.ProtocolError, match="source rank 0: the NIXL metadata of its buffer"):
            peer = transport.connect(address, "source rank 0")
            transport.post_read(peer, key[:5] + b"\xff" * (len(key) - 5), remote, 0, 0, 1)  # corrupt key
        transport.disconnect(peer)
        peer = transport.connect(address, "source rank 0")
        parent.send(transport.address())
        local = np.zeros(length, np.uint8)
        region = transport.register(local.ctypes.data, local.nbytes, -1)

        def wait(read):
            deadline = time.monotonic() + 20
            while not transport.test_read(read):
                assert time.monotonic() < deadline, "a read did not complete"

        wait(transport.post_read(peer, key, remote, local.ctypes.data, region, length))
        assert local.tobytes() == payload
        local[:] = 0
        wait(transport.post_read(peer, key, remote + 100, local.ctypes.data + 7, region, 1000))
        assert local[7:1007].tobytes() == payload[100:1100] and not local[:7].any() and not local[1007:].any()

        for i in range(50):  # ordered, whatever their sizes
            transport.send(peer, bytes([i]) * (1 + i * 20000))
        for i in range(50):
            deadline = time.monotonic() + 20
            message = None
            while message is None:
                assert time.monotonic() < deadline, f"answer {i} did not come"
                message = transport.poll(peer)
            assert message == bytes([i]) * (1 + i * 20000)

        with pytest.raises(refit.RefitError, match="NIXL READ of 4096 bytes from source rank 0"):
            read = transport.post_read(peer, key, remote + length, local.ctypes.data, region, 4096)  # past its end
            wait(read)

        parent.send("exit")
        proc.join(20)
        with pytest.raises(refit.PeerLostError, match="source rank 0"):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                wait(transport.post_read(peer, key, remote, local.ctypes.data, region, length))
                transport.poll(peer)
                time.sleep(0.05)
        transport.deregister(region)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


@needs_nixl
def test_release_after_refit_connects_again_with_large_manifests():
    """release_after_refit: every refit frees the buffers and disconnects, the next prepares and
    connects again to the same peer. 3,000 small tensors make manifests of well over 100 KB."""
    rng = np.random.default_rng(5)
    weights = [(f"model.layers.{i}.w", rng.standard_normal(17 + i % 50).astype(np.float32)) for i in range(3000)]
    pair = Pair(4 * MiB, nixl_config(release_after_refit=True))
    try:
        for _ in range(3):
            got = {}
            pair.refit(weights, load=lambda batch: got.update(
                {n: (refit.xxh3_64(t), t.dtype.name, tuple(t.shape)) for n, t in batch}))
            assert got == expected(weights)
            pair.source.finalize()
            pair.destination.finalize()
            pair.connect()
    finally:
        pair.close()


def _cuda_usable() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and refit.cuda_built()
    except ImportError:
        return False


@needs_nixl
@pytest.mark.skipif(not _cuda_usable(), reason="needs PyTorch with a GPU and refit built with CUDA")
def test_gpu_tensors_through_gpu_buffers_registered_as_vram():
    import torch

    gen = torch.Generator(device="cuda").manual_seed(11)
    weights = [("embed", torch.randn(3000, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)),  # split
               ("norm", torch.randn(1024, device="cuda", generator=gen)),
               ("empty", torch.zeros(0, 4, device="cuda"))]
    pair = Pair(2 * MiB, nixl_config(device="cuda"), framework="torch")
    try:
        got = {}
        _, stats = pair.refit(weights, load=lambda batch: got.update({n: t.clone() for n, t in batch}))
        assert stats["route"] == "NIXL UCX" and stats["buffer_bytes"] > 0
        probe = refit.nixl.NixlTransport(nixl_config(device="cuda"))
        assert probe.backend_params["engine_config"] == "CUDA_IPC_ENABLE_GET_ZCOPY=y"  # CUDA IPC reads on
        for name, tensor in weights:
            assert got[name].is_cuda and torch.equal(got[name], tensor), name
    finally:
        pair.close()
