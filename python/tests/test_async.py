"""The async forms of refit's engine (send_weights_async, receive_weight_batches_async,
receive_weights_async) between two real engines in this process, and what cancelling them does."""

from __future__ import annotations

import asyncio
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import refit

from helpers import Pair, config, hashes

MiB = 1 << 20


def make_weights(seed: int, count: int = 6):
    rng = np.random.default_rng(seed)
    out = [(f"layers.{i}.w", rng.standard_normal(150_000, dtype=np.float32)) for i in range(count)]  # 600 KB each
    out.append(("embed", rng.standard_normal((1500, 1024)).astype(ml_dtypes.bfloat16)))           # 3 MB: merged
    return out


def gated(weights, gate: threading.Event, after: int):
    """Yields `after` pairs, then waits for `gate` before yielding the rest."""
    for i, pair in enumerate(weights):
        if i == after:
            assert gate.wait(20), "the test never opened the gate"
        yield pair


def test_send_and_iterate_in_one_event_loop():
    pair = Pair(MiB)
    try:
        for seed in (1, 2):  # twice: the engines are idle and reusable afterwards
            sent = make_weights(seed)

            async def consume():
                got, batches = {}, 0
                async with pair.destination.receive_weight_batches_async() as it:
                    async for batch in it:
                        batches += 1
                        got.update(hashes(batch))
                        await asyncio.sleep(0)  # the loop runs other tasks between batches
                    return got, batches, it.stats

            async def main():
                return await asyncio.gather(pair.source.send_weights_async(sent), consume())

            stats, (got, batches, rstats) = asyncio.run(main())
            assert got == hashes(sent)
            assert stats["tensors"] == len(sent) and stats["had_peer"]
            assert rstats["tensors"] == len(sent) and rstats["batches"] == batches > 1
            assert not pair.destination.stale
    finally:
        pair.close()


def test_receive_weights_async_runs_load_on_a_worker_thread():
    pair = Pair(MiB)
    try:
        sent = make_weights(3)
        got, threads = {}, set()

        def load(batch):
            threads.add(threading.get_ident())
            got.update(hashes(batch))

        async def main():
            loop_thread = threading.get_ident()
            stats, rstats = await asyncio.gather(pair.source.send_weights_async(sent),
                                                 pair.destination.receive_weights_async(load, framework="numpy"))
            return loop_thread, stats, rstats

        loop_thread, stats, rstats = asyncio.run(main())
        assert got == hashes(sent) and rstats["tensors"] == len(sent)
        assert threads and loop_thread not in threads
    finally:
        pair.close()


def test_leaving_the_async_loop_early_fails_the_refit():
    pair = Pair(MiB)
    try:
        async def main():
            send = asyncio.ensure_future(pair.source.send_weights_async(make_weights(4)))
            async with pair.destination.receive_weight_batches_async() as it:
                async for batch in it:
                    break
            with pytest.raises(refit.RefitError):
                await send
            return it

        it = asyncio.run(main())
        assert pair.destination.stale and it.stats is None
    finally:
        pair.close()


def test_cancelling_the_destination_fails_the_refit_and_leaves_the_engine_idle():
    pair = Pair(MiB)
    gate = threading.Event()
    try:
        async def main():
            first = asyncio.Event()

            async def consume():
                async for batch in pair.destination.receive_weight_batches_async():
                    first.set()

            send = asyncio.ensure_future(pair.source.send_weights_async(gated(make_weights(5), gate, 3)))
            receive = asyncio.ensure_future(consume())
            await asyncio.wait_for(first.wait(), 20)
            await asyncio.sleep(0.2)       # the consumer waits in its next batch now
            receive.cancel()
            # The waiting __next__ sees the close within its 100 ms wait slice: the receive ends at
            # once, before the (gated) source has sent its next bucket.
            done, _ = await asyncio.wait({receive}, timeout=5)
            assert receive in done
            with pytest.raises(asyncio.CancelledError):
                await receive
            gate.set()
            with pytest.raises(refit.RefitError):
                await send

        asyncio.run(main())
        assert pair.destination.stale
        pair.destination.prepare()  # idle: nothing is still running on it
    finally:
        gate.set()
        pair.close()


def test_cancelling_the_source_fails_the_refit():
    pair = Pair(MiB)
    gate = threading.Event()
    try:
        async def main():
            first = asyncio.Event()
            received = []

            async def consume():
                async for batch in pair.destination.receive_weight_batches_async():
                    received.extend(name for name, _ in batch)
                    first.set()

            send = asyncio.ensure_future(pair.source.send_weights_async(gated(make_weights(6), gate, 3)))
            receive = asyncio.ensure_future(consume())
            await asyncio.wait_for(first.wait(), 20)
            send.cancel()
            await asyncio.sleep(0.1)
            gate.set()  # the next pull from the weights raises: the refit fails on both sides
            with pytest.raises(asyncio.CancelledError):
                await send
            with pytest.raises(refit.RefitError, match="cancelled"):
                await receive
            return received

        received = asyncio.run(main())
        assert 0 < len(received) < 7
        assert pair.destination.stale
    finally:
        gate.set()
        pair.close()


def test_a_timeout_around_an_async_receive_cancels_it():
    pair = Pair(MiB, config(timeout_s=2))
    try:
        async def main():
            start = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(pair.destination.receive_weights_async(lambda batch: None), 0.3)
            return time.monotonic() - start

        # nothing is sent: the cancelled receive ends with the engine's own deadline (timeout_s),
        # and the cancellation waits for it, so that the engine is idle afterwards
        assert 1.5 < asyncio.run(main()) < 15
        assert pair.destination.stale
    finally:
        pair.close()
