"""The receive side's contract: zero-copy views valid until the next batch is requested, merged
tensors owned, stopping early or holding a batch too long fails the refit (never hangs), and the
destination is then stale; the GIL is free during transfers."""

from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import refit

from helpers import Pair, config

MiB = 1 << 20


def distinct_weights(refit_index: int, count: int = 6, bucket_elems: int = MiB // 4):
    """`count` float32 tensors of one full bucket each (one bucket, one batch per tensor), plus
    one 2.5-bucket tensor that is split and merged; content depends on the refit."""
    weights = [(f"w{i}", np.full(bucket_elems, refit_index * 100 + i, np.float32)) for i in range(count)]
    weights.append(("big", np.arange(int(bucket_elems * 2.5), dtype=np.float32) + refit_index))
    return weights


def test_views_are_valid_until_the_next_batch_and_then_reused():
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))
        it = pair.destination.receive_weight_batches(framework="numpy")
        views = {}
        for batch in it:
            for name, t in batch:
                # Valid now, during this batch:
                if name.startswith("w"):
                    assert t[0] == 100 + int(name[1:]) and t[-1] == t[0]
                    assert not t.flags.owndata  # a view into a transfer buffer
                views[name] = (t, t.copy())
        sender.join()
        # After the refit, the transfer buffers held later buckets: an early view shows other data.
        t0, copy0 = views["w0"]
        assert not np.array_equal(t0, copy0)
        # The merged tensor is owned: still the data it had.
        big, big_copy = views["big"]
        assert np.array_equal(big, big_copy)
    finally:
        pair.close()


def test_merged_tensors_are_owned_across_refits():
    pair = Pair(MiB)
    try:
        kept = {}
        pair.refit(distinct_weights(1), lambda b: kept.update(b))
        big = kept["big"]
        expected = np.arange(big.size, dtype=np.float32) + 1
        assert np.array_equal(big, expected)
        # The next refit merges the same tensor again (with other content): ours must not change.
        pair.refit(distinct_weights(2), lambda b: None)
        assert np.array_equal(big, expected)
        kept.clear()
        del big
        gc.collect()
        pair.refit(distinct_weights(3), lambda b: None)  # the freed buffer is the engine's again
    finally:
        pair.close()


@pytest.mark.parametrize("how", ["break", "close", "finalize"])
def test_stopping_early_fails_the_refit_and_leaves_the_destination_stale(how):
    pair = Pair(MiB, config(timeout_s=30))
    try:
        sender = pair.start_send(distinct_weights(1))
        it = pair.destination.receive_weight_batches()
        start = time.monotonic()
        for batch in it:
            break
        if how == "break":
            del it, batch  # the iterator is dropped: garbage collection closes it
            gc.collect()
        elif how == "close":
            it.close()
            assert "stopped iterating" in it.error
            assert it.stats is None
        else:
            pair.destination.finalize()
        with pytest.raises(refit.RefitError) as err:
            sender.join()
        assert time.monotonic() - start < 10, "the refit must fail at once, not at the deadline"
        message = str(err.value)
        assert "destination rank 0" in message
        assert pair.destination.stale
        # Recovery: a fresh destination engine, a fresh metadata exchange. (Reconnecting the same
        # two engines can meet the failed refit's in-flight messages: a C++ engine limitation.)
        pair.source.finalize()
        pair.destination.close()
        pair.destination = refit.CheckpointEngine(MiB, config(timeout_s=30), session=pair.session,
                                                  framework="numpy")
        pair.connect()
        got = {}
        pair.refit(distinct_weights(2), lambda b: got.update({n: float(t[0]) for n, t in b}))
        assert got["w3"] == 203 and not pair.destination.stale
    finally:
        pair.close()


@pytest.mark.parametrize("call", ["finalize", "close"])
def test_a_loop_that_goes_on_after_its_refit_was_stopped_raises_instead_of_ending(call):
    # A shutdown path run from inside the loop (the engine's finalize(), the iterator's close())
    # fails the refit; the loop around it must not then end as if the whole model had arrived.
    pair = Pair(MiB, config(timeout_s=30))
    try:
        sender = pair.start_send(distinct_weights(1))
        it = pair.destination.receive_weight_batches()
        batches = 0
        with pytest.raises(refit.InvalidArgumentError, match="finalize\\(\\) was called|stopped iterating"):
            for _ in it:
                batches += 1
                if batches == 2:
                    pair.destination.finalize() if call == "finalize" else it.close()
        assert batches == 2
        assert it.stats is None and it.error
        with pytest.raises(refit.InvalidArgumentError):  # and again: it stays failed
            next(it)
        assert pair.destination.stale
        with pytest.raises(refit.RefitError, match="destination rank 0"):
            sender.join()
    finally:
        pair.close()


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_or_exit_from_caller_code_stays_itself_and_fails_the_refit_everywhere(raised):
    # Not an Exception: refit must not turn it into one (`except Exception` would catch Ctrl-C).
    pair = Pair(MiB, config(timeout_s=30))
    try:
        def stream():
            yield from distinct_weights(1)[:2]
            raise raised()

        sender = pair.start_send(stream())
        start = time.monotonic()
        with pytest.raises(refit.RefitError, match="weight iterator raised"):
            pair.destination.receive_weights(lambda batch: None)
        with pytest.raises(raised) as err:
            sender.join()
        assert any("weight iterator raised" in note for note in getattr(err.value, "__notes__", []))
        # The loader's side: the source is told at once.
        sender = pair.start_send(distinct_weights(2))

        def load(batch):
            raise raised()

        with pytest.raises(raised):
            pair.destination.receive_weights(load)
        with pytest.raises(refit.RefitError, match="the loader raised"):
            sender.join()
        assert time.monotonic() - start < 10, "both refits must fail at once, not at the deadline"
    finally:
        pair.close()


def test_a_program_that_ends_while_a_daemon_thread_waits_in_a_receive_exits_cleanly():
    # CPython (3.13 and older) unwinds a daemon thread that wants the GIL back once finalizing has
    # begun; through refit's C++ frames that aborted the process ("terminate called without an
    # active exception", exit status -6) about every other run.
    program = textwrap.dedent("""
        import threading, time, refit
        session = refit.new_session_id()
        cfg = {"nixl": {"timeout_s": 30}, "session": session, "framework": "numpy"}
        src = refit.create_checkpoint_engine("nixl", 1 << 20, dict(cfg))
        dst = refit.create_checkpoint_engine("nixl", 1 << 20, dict(cfg))
        md = [src.prepare(), dst.prepare()]
        src.init_policy_process_group(0, 1, 1, md)
        dst.init_rollout_process_group(0, 1, 1, md)
        threading.Thread(target=lambda: dst.receive_weights(lambda batch: None), daemon=True).start()
        time.sleep(0.5)
    """)
    for _ in range(4):
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "terminate called" not in run.stderr


def test_a_consumer_holding_a_batch_past_the_deadline_fails_the_refit():
    pair = Pair(MiB, config(timeout_s=1))
    try:
        sender = pair.start_send(distinct_weights(1))
        it = pair.destination.receive_weight_batches()
        next(it)
        time.sleep(2.5)
        with pytest.raises(refit.RefitTimeoutError, match="held batch 0 for more than timeout_s=1"):
            for _ in it:
                pass
        with pytest.raises(refit.RefitError):
            sender.join()
        assert pair.destination.stale
    finally:
        pair.close()


def test_a_failing_loader_fails_the_refit_for_both_sides():
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))
        it = pair.destination.receive_weight_batches()
        with pytest.raises(KeyError):
            for batch in it:
                raise KeyError("the model has no such parameter")
        # The loop's exception drops the iterator (CPython frees it at once): the refit fails.
        del it
        with pytest.raises(refit.RefitError, match="stopped iterating"):
            sender.join()
        assert pair.destination.stale
    finally:
        pair.close()


def test_the_gil_is_released_during_transfers_and_waits():
    pair = Pair(MiB)
    try:
        ticks = []
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.001)

        t = threading.Thread(target=ticker)
        t.start()
        # The destination waits in receive (GIL released) while the source is slow to start.
        def slow_weights():
            time.sleep(0.5)
            yield from distinct_weights(1)

        sender = pair.start_send(slow_weights())
        before = len(ticks)
        stats = pair.destination.receive_weights(lambda b: None)
        sender.join()
        stop.set()
        t.join()
        assert stats["tensors"] == 7
        assert len(ticks) - before > 100, "another Python thread must run while refit waits"
    finally:
        pair.close()


def test_receive_statistics_and_batches():
    pair = Pair(MiB)
    try:
        sizes = []
        sstats, rstats = pair.refit(distinct_weights(1), lambda b: sizes.append(len(b)))
        assert sstats["tensors"] == rstats["tensors"] == 7
        assert rstats["batches"] == len(sizes)
        assert rstats["payload_bytes"] == sstats["payload_bytes"] == (6 + 2.5) * MiB
    finally:
        pair.close()


def test_ctrl_c_while_waiting_cancels_the_refit():
    import _thread
    import signal

    # interrupt_main() does nothing when SIGINT is ignored or left to the OS, which an earlier test
    # (Ray's driver) may have done: make Ctrl-C raise KeyboardInterrupt, as in a plain interpreter.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pair = Pair(MiB, config(timeout_s=30))
    try:
        def late_weights():
            time.sleep(1.0)
            yield from distinct_weights(1)

        sender = pair.start_send(late_weights())
        threading.Timer(0.3, _thread.interrupt_main).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            for _ in pair.destination.receive_weight_batches():
                pass
        assert time.monotonic() - start < 5
        assert pair.destination.stale
        with pytest.raises(refit.RefitError):
            sender.join()
    finally:
        pair.close()
        signal.signal(signal.SIGINT, previous)


def test_merged_tensors_stay_correct_whether_kept_or_dropped():
    # A merged tensor shares the engine's merge buffer: one that is dropped gives it back for the
    # next refit, one that is kept keeps it (the engine merges into a fresh one). Either way every
    # refit's merged tensor has that refit's content, and a kept one keeps its own.
    pair = Pair(MiB)
    try:
        kept = []
        for index in range(1, 7):
            got = {}
            pair.refit(distinct_weights(index), lambda b: got.update(b))
            big = got.pop("big")
            assert np.array_equal(big, np.arange(big.size, dtype=np.float32) + index)
            if index % 3 == 0:
                kept.append((index, big))  # held across later refits
            got.clear()
            big = None
            gc.collect()
        for index, big in kept:
            assert np.array_equal(big, np.arange(big.size, dtype=np.float32) + index)
    finally:
        pair.close()


def test_receive_weights_calls_back_with_the_same_contract():
    pair = Pair(MiB)
    try:
        kept = {}
        sender = pair.start_send(distinct_weights(4))
        stats = pair.destination.receive_weights(lambda b: kept.update(b))
        sender.join()
        assert stats["tensors"] == 7 and not pair.destination.stale
        big = kept["big"]
        assert np.array_equal(big, np.arange(big.size, dtype=np.float32) + 4)  # merged: owned
        assert not kept["w0"].flags.owndata  # a view, valid only during its call
    finally:
        pair.close()


def test_an_exception_in_the_load_callback_fails_the_refit_with_its_cause():
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))

        def load(batch):
            raise KeyError("model.layers.0.missing")

        with pytest.raises(refit.InvalidArgumentError) as err:
            pair.destination.receive_weights(load)
        assert "the loader raised KeyError: 'model.layers.0.missing'" in str(err.value)
        assert str(err.value).startswith("destination rank 0, refit 1 of this connection, phase load bucket 0")
        assert isinstance(err.value.__cause__, KeyError)
        assert pair.destination.stale
        with pytest.raises(refit.RefitError, match="destination rank 0"):
            sender.join()
    finally:
        pair.close()


def test_a_refit_error_raised_by_the_load_callback_fails_the_source_with_its_class():
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))

        def load(batch):
            raise refit.LayoutError("this engine holds no tensor 'w0'")

        with pytest.raises(refit.LayoutError, match="the loader raised LayoutError: this engine holds no tensor"):
            pair.destination.receive_weights(load)
        # The source fails with the destination's kind, not a generic one.
        with pytest.raises(refit.LayoutError, match="this engine holds no tensor 'w0'"):
            sender.join()
    finally:
        pair.close()


@pytest.mark.parametrize("receive", ["callback", "iterator"])
def test_a_batch_the_framework_cannot_take_fails_the_refit_on_both_sides_at_once(receive):
    # CuPy is not installed here: handing a batch over as CuPy arrays fails before any load. The
    # source must hear of it at once, not at its deadline (timeout_s is 20 s here).
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: its arrays can be made")
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))
        start = time.monotonic()
        with pytest.raises(TypeError, match="could not export"):  # the conversion's own error
            if receive == "callback":
                pair.destination.receive_weights(lambda batch: None, framework="cupy")
            else:
                for _ in pair.destination.receive_weight_batches(framework="cupy"):
                    pass
        assert pair.destination.stale
        with pytest.raises(refit.RefitError, match="destination rank 0 .*converting batch 0 to Python objects failed"):
            sender.join()
        assert time.monotonic() - start < 5
    finally:
        pair.close()


def test_the_engine_cannot_be_closed_from_its_own_load_callback():
    pair = Pair(MiB)
    try:
        sender = pair.start_send(distinct_weights(1))

        def load(batch):
            pair.destination.close()

        with pytest.raises(refit.InvalidArgumentError) as err:
            pair.destination.receive_weights(load)
        assert isinstance(err.value.__cause__, refit.InvalidArgumentError)
        assert "close() inside receive_weights()'s load callback" in str(err.value.__cause__)
        with pytest.raises(refit.RefitError):
            sender.join()
    finally:
        pair.close()


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "staged"])
def test_a_receive_only_destination_holds_buffers_only_when_it_cannot_map(mapped):
    pair = Pair(MiB, config(map_source_buffers=mapped), receives_only=True)
    try:
        for index in (1, 2):
            got = {}
            _, stats = pair.refit(distinct_weights(index), lambda b: got.update(b))
            assert sorted(got) == sorted(name for name, _ in distinct_weights(index))
            # In one process UCX may or may not map its own shared memory; the buffers follow it.
            assert stats["buffer_bytes"] == (0 if stats["mapped"] else 2 * MiB)
            if not mapped:
                assert not stats["mapped"]
        with pytest.raises(refit.RefitError, match="receive only"):
            pair.destination.init_policy_process_group(0, 1, 1, [pair.source.prepare(), pair.destination.prepare()])
    finally:
        pair.close()
