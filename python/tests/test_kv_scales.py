"""FP8 KV-cache scales (the reference's kv_cache_dtype starting with "fp8") between two real
engines, and the destination's FP8 quantizing loader."""

from __future__ import annotations

import asyncio
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import refit

from helpers import TINY_MOE, Pair, config, hashes

MiB = 1 << 20
SUFFIXES = ("self_attn.attn.q_scale", "self_attn.k_scale", "self_attn.v_scale")


def scale_names(num_layers: int):
    return [f"model.layers.{i}.{suffix}" for i in range(num_layers) for suffix in SUFFIXES]


def make_weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        ("model.embed_tokens.weight", rng.standard_normal((300, 1024), dtype=np.float32)),  # split over buckets
        ("model.layers.0.self_attn.q_proj.weight", rng.standard_normal((200, 130)).astype(ml_dtypes.bfloat16)),
        ("model.layers.0.input_layernorm.weight", rng.standard_normal(64).astype(ml_dtypes.bfloat16)),
        ("model.layers.1.mlp.down_proj.weight", (0.01 * rng.standard_normal((40, 300))).astype(np.float32)),
    ]


def fp8_pair(num_layers=None, model=None, kv_cache_dtype="fp8", **kwargs):
    source_options = {"kv_cache_dtype": kv_cache_dtype}
    if num_layers is not None:
        source_options["num_layers"] = num_layers
    if model is not None:
        source_options["model"] = model
    return Pair(MiB, source_options=source_options, destination_options={"kv_cache_dtype": kv_cache_dtype}, **kwargs)


def receive_all(pair, weights, **send_kwargs):
    """One refit; every received tensor in order as (name, copy)."""
    got = []

    def load(batch):
        got.extend((name, np.array(t, copy=True)) for name, t in batch)

    sstats, rstats = pair.refit(weights, load, send_kwargs=send_kwargs)
    return got, sstats, rstats


def test_fp8_appends_every_layers_scales_after_the_weights():
    pair = fp8_pair(num_layers=3)
    try:
        assert pair.source.kv_scale_layers == 3
        weights = make_weights()
        given = {
            "model.layers.0.self_attn.attn.q_scale": 0.5,
            "model.layers.1.self_attn.k_scale": 0.25,
            "model.layers.2.self_attn.v_scale": np.float32(2.0),  # any number
            "model.layers.7.self_attn.k_scale": 9.0,  # no such layer: ignored, as the reference does
            "not.a.scale": 3.0,  # ignored
        }
        got, sstats, rstats = receive_all(pair, weights, kv_scales=given)
        names = [name for name, _ in got]
        # The weights first, unchanged, then layer by layer q, k, v.
        assert names == [n for n, _ in weights] + scale_names(3)
        assert hashes(got[:len(weights)]) == hashes(weights)
        scales = dict(got[len(weights):])
        for name, value in scales.items():
            assert value.dtype == np.float32 and value.shape == (1,), name
            assert refit.is_kv_scale_name(name)
        expected = {name: given.get(name, 1.0) for name in scale_names(3)}
        assert {n: float(v[0]) for n, v in scales.items()} == expected
        assert sstats["tensors"] == rstats["tensors"] == len(weights) + 9
        assert rstats["payload_bytes"] == sum(t.nbytes for _, t in weights) + 9 * 4

        # Every refit appends them again, with that refit's values.
        got, _, _ = receive_all(pair, make_weights(1), kv_scales={"model.layers.1.self_attn.k_scale": 0.125})
        scales = {n: float(v[0]) for n, v in got[4:]}
        assert scales == {n: (0.125 if n == "model.layers.1.self_attn.k_scale" else 1.0) for n in scale_names(3)}
    finally:
        pair.close()


def test_fp8_without_kv_scales_sends_ones():
    # The reference: the value given for a name, else 1.0 (also when kv_scales is None).
    pair = fp8_pair(num_layers=2, kv_cache_dtype="fp8_e4m3")
    try:
        got, _, _ = receive_all(pair, make_weights())
        assert [n for n, _ in got[4:]] == scale_names(2)
        assert all(float(v[0]) == 1.0 for _, v in got[4:])
    finally:
        pair.close()


def test_layer_count_from_the_model():
    inventory = refit.load_model_inventory(TINY_MOE)
    layers = 1 + max(int(t.name.split(".")[2]) for t in inventory.tensors if t.name.startswith("model.layers."))
    pair = fp8_pair(model=TINY_MOE)
    try:
        assert pair.source.kv_scale_layers == layers
        got, _, _ = receive_all(pair, make_weights(), kv_scales={f"model.layers.{layers - 1}.self_attn.v_scale": 4.0})
        assert [n for n, _ in got[4:]] == scale_names(layers)
        assert float(got[-1][1][0]) == 4.0
    finally:
        pair.close()
    # model= and num_layers= together must agree.
    with pytest.raises(refit.ConfigError, match="num_layers"):
        refit.CheckpointEngine(MiB, config(), kv_cache_dtype="fp8", model=inventory, num_layers=layers + 1)
    engine = refit.CheckpointEngine(MiB, config(), kv_cache_dtype="fp8", model=inventory, num_layers=layers)
    assert engine.kv_scale_layers == layers
    engine.close()


def test_fp8_without_a_layer_count_is_an_error():
    pair = fp8_pair()
    try:
        assert pair.source.kv_scale_layers is None
        with pytest.raises(refit.ConfigError, match=r"model= .*num_layers="):
            pair.source.send_weights(make_weights(), kv_scales={"model.layers.0.self_attn.k_scale": 1.0})
        with pytest.raises(refit.ConfigError, match="num_layers="):
            pair.source.send_weights(make_weights())
    finally:
        pair.close()


def test_bad_layer_counts_and_kv_scales_are_errors():
    with pytest.raises(refit.ConfigError, match="num_layers"):
        refit.CheckpointEngine(MiB, config(), kv_cache_dtype="fp8", num_layers=-1)
    with pytest.raises(refit.ConfigError, match="num_layers"):
        refit.CheckpointEngine(MiB, config(), kv_cache_dtype="fp8", num_layers="2")
    with pytest.raises(refit.ConfigError, match="kv_cache_dtype"):
        refit.CheckpointEngine(MiB, config(), kv_cache_dtype=None)
    pair = fp8_pair(num_layers=2)
    try:
        with pytest.raises(refit.InvalidArgumentError, match="must be a number"):
            pair.source.send_weights(make_weights(), kv_scales={"model.layers.0.self_attn.k_scale": "big"})
        with pytest.raises(refit.InvalidArgumentError, match="must be a number, got a bool"):
            pair.source.send_weights(make_weights(), kv_scales={"model.layers.0.self_attn.k_scale": True})
        # A KV cache quantized by any of these is garbage that nothing downstream notices.
        for bad in (float("nan"), float("inf"), -0.5, 0.0, 1e300):
            with pytest.raises(refit.InvalidArgumentError, match="finite number above 0"):
                pair.source.send_weights(make_weights(), kv_scales={"model.layers.1.self_attn.v_scale": bad})
        with pytest.raises(refit.InvalidArgumentError, match="keys must be str"):
            pair.source.send_weights(make_weights(), kv_scales={0: 1.0})
        with pytest.raises(refit.InvalidArgumentError, match="must be a dict"):
            pair.source.send_weights(make_weights(), kv_scales=[("model.layers.0.self_attn.k_scale", 1.0)])
        # Each refused send failed a refit (its destination was told); connected again, the engines refit.
        pair.connect()
        got, _, _ = receive_all(pair, make_weights(), kv_scales={"model.layers.0.self_attn.k_scale": 0.75})
        assert float(dict(got)["model.layers.0.self_attn.k_scale"][0]) == 0.75
    finally:
        pair.close()


def test_auto_sends_no_scales_and_refuses_kv_scales():
    pair = Pair(MiB, source_options={"num_layers": 4})  # kv_cache_dtype "auto", the default
    try:
        assert pair.source.kv_scale_layers is None
        weights = make_weights()
        got, sstats, _ = receive_all(pair, weights)
        assert [n for n, _ in got] == [n for n, _ in weights]
        assert sstats["tensors"] == len(weights)
        with pytest.raises(refit.InvalidArgumentError, match="kv_cache_dtype is 'auto'"):
            pair.source.send_weights(weights, kv_scales={"model.layers.0.self_attn.k_scale": 0.5})
        pair.connect()  # the refused send failed that refit on both sides
        got, _, _ = receive_all(pair, weights)
        assert not any(refit.is_kv_scale_name(n) for n, _ in got)
    finally:
        pair.close()


@pytest.mark.parametrize("bad", ["auto engine", "not a number", "not iterable"])
def test_a_refused_send_ends_its_destinations_refit_at_once(bad):
    # The destination waits with timeout_s = 60: it must hear of the source's argument error now.
    pair = Pair(MiB, config(timeout_s=60), source_options={"num_layers": 2, "kv_cache_dtype":
                                                             "auto" if bad == "auto engine" else "fp8"},
                destination_options={"kv_cache_dtype": "auto" if bad == "auto engine" else "fp8"})
    try:
        errors = []
        receiving = threading.Thread(target=lambda: errors.append(_receive_error(pair)))
        receiving.start()
        start = time.monotonic()
        weights = 42 if bad == "not iterable" else make_weights()
        scales = {"model.layers.0.self_attn.k_scale": "big" if bad == "not a number" else 0.5}
        with pytest.raises(refit.InvalidArgumentError) as sent:
            pair.source.send_weights(weights, kv_scales=None if bad == "not iterable" else scales)
        receiving.join(30)
        assert not receiving.is_alive()
        assert time.monotonic() - start < 10, "the destination waited for its deadline"
        [received] = errors
        assert isinstance(received, refit.InvalidArgumentError), received
        why = {"auto engine": "kv_cache_dtype is 'auto'", "not a number": "must be a number",
               "not iterable": "'int' object is not iterable"}[bad]
        assert why in str(sent.value) and why in str(received), (sent.value, received)
        assert "source rank 0 aborted the refit" in str(received)
        pair.connect()  # both sides failed that refit; connected again, they refit
        got, _, _ = receive_all(pair, make_weights())
        assert len(got) >= len(make_weights())
    finally:
        pair.close()


def _receive_error(pair):
    try:
        for _ in pair.destination.receive_weight_batches():
            pass
    except refit.RefitError as e:
        return e
    return None


def test_engine_kwargs_carry_the_options():
    engine = refit.create_checkpoint_engine("nixl", MiB, {"nixl": {"timeout_s": 20}, "kv_cache_dtype": "fp8",
                                                          "num_layers": 5})
    assert engine.kv_scale_layers == 5
    engine.close()
    engine = refit.create_checkpoint_engine("nixl", MiB, {"timeout_s": 20}, kv_cache_dtype="fp8", num_layers=2)
    assert engine.kv_scale_layers == 2
    engine.close()


def test_send_weights_async_passes_kv_scales():
    pair = fp8_pair(num_layers=1)
    try:
        got = []

        async def main():
            send = asyncio.ensure_future(
                pair.source.send_weights_async(make_weights(), kv_scales={"model.layers.0.self_attn.v_scale": 0.5}))
            async with pair.destination.receive_weight_batches_async() as batches:
                async for batch in batches:
                    got.extend((n, np.array(t, copy=True)) for n, t in batch)
            return await send

        stats = asyncio.run(main())
        assert stats["tensors"] == 4 + 3
        assert {n: float(v[0]) for n, v in got[4:]} == {
            "model.layers.0.self_attn.attn.q_scale": 1.0,
            "model.layers.0.self_attn.k_scale": 1.0,
            "model.layers.0.self_attn.v_scale": 0.5,
        }
    finally:
        pair.close()


def test_name_predicates():
    assert refit.is_kv_scale_name("model.layers.3.self_attn.attn.q_scale")
    assert refit.is_kv_scale_name("model.layers.3.self_attn.k_scale")
    assert refit.is_kv_scale_name("model.layers.3.self_attn.v_scale")
    assert not refit.is_kv_scale_name("model.layers.3.self_attn.q_scale")
    assert not refit.is_kv_scale_name("model.layers.3.self_attn.k_proj.weight")
    assert refit.is_fp8_linear_weight("model.layers.0.mlp.down_proj.weight", "bfloat16", [8, 8])
    assert not refit.is_fp8_linear_weight("model.layers.0.mlp.down_proj.weight", "bfloat16", [8])
    assert not refit.is_fp8_linear_weight("model.embed_tokens.weight", "float32", [8, 8])
    assert not refit.is_fp8_linear_weight("model.layers.0.mlp.down_proj.weight", "int8", [8, 8])


def block_amax(x: np.ndarray) -> np.ndarray:
    m, n = x.shape
    out = np.zeros(((m + 127) // 128, (n + 127) // 128), np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = np.abs(x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
    return out


def test_fp8_quantizing_loader_at_the_destination():
    pair = fp8_pair(num_layers=2)
    try:
        weights = make_weights(3)
        fp8, other, post_loads = {}, {}, []
        loader = refit.Fp8QuantizingLoader(
            lambda name, data, scale_inv: fp8.__setitem__(name, (data, scale_inv)),
            lambda name, tensor: other.__setitem__(name, np.array(tensor, copy=True)),
            post_load=post_loads.append)
        sender = pair.start_send(weights, kv_scales={"model.layers.1.self_attn.k_scale": 0.25})
        pair.destination.receive_weights(loader, framework="numpy")
        sender.join()
        assert post_loads == []  # only finish_refit() calls it
        loader.finish_refit()

        assert sorted(fp8) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
        assert sorted(other) == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]
        assert hashes(other.items()) == hashes([(n, t) for n, t in weights if n in other])
        source = dict(weights)
        for name, (data, scale_inv) in fp8.items():
            x = source[name].astype(np.float32)
            assert data.dtype == ml_dtypes.float8_e4m3fn and data.shape == x.shape
            amax = np.maximum(block_amax(x), 1e-4)
            np.testing.assert_allclose(scale_inv, amax / 448, rtol=1e-6)
            expanded = np.kron(scale_inv, np.ones((128, 128), np.float32))[:x.shape[0], :x.shape[1]]
            dequantized = data.astype(np.float32) * expanded
            assert np.all(np.abs(dequantized - x) <= np.abs(x) / 16 + expanded * 2.0 ** -9 + 1e-12), name

        assert len(post_loads) == 1
        assert post_loads[0] == {n: (0.25 if n == "model.layers.1.self_attn.k_scale" else 1.0)
                                 for n in scale_names(2)}
        loader.finish_refit()  # forgets the scales once reported
        assert post_loads[-1] == {}
    finally:
        pair.close()


def test_fp8_loader_options_and_errors():
    seen = []
    loader = refit.Fp8QuantizingLoader(lambda *a: seen.append(("fp8",) + a[:1]),
                                       lambda name, t: seen.append(("other", name)),
                                       quantize=lambda info: info.name.endswith("w"), scaling="per_tensor")
    w = np.ones((4, 4), np.float32)
    loader([("a.w", w), ("b.weight", w)])
    assert seen == [("fp8", "a.w"), ("other", "b.weight")]
    with pytest.raises(refit.LayoutError, match="k_scale"):
        loader([("model.layers.0.self_attn.k_scale", np.ones(2, np.float32))])
    with pytest.raises(refit.InvalidArgumentError, match="scaling"):
        refit.Fp8QuantizingLoader(lambda *a: None, lambda *a: None, scaling="block64")
    with pytest.raises(ZeroDivisionError):  # a callback's exception propagates
        refit.Fp8QuantizingLoader(lambda *a: None, lambda *a: 1 / 0)([("x", np.ones(3, np.float32))])


# ---- through the driver: refit.EngineWorker sends its program's kv_scales -------------------------

class ScaledSource:
    """A source program whose kv_scales change every refit."""

    def __init__(self, scales: bool = True):
        self.scales = scales

    def weights(self, index):
        return make_weights(seed=index)

    def kv_scales(self, index):
        if not self.scales:
            return None
        return {"model.layers.0.self_attn.k_scale": 0.5 + index, "model.layers.1.self_attn.attn.q_scale": 4.0}


class Recorder:
    """A destination program that keeps a copy of every tensor of the last refit."""

    def __init__(self):
        self.got = {}

    def load(self, index, batch):
        self.got.update((name, np.array(t, copy=True)) for name, t in batch)


def driver_group(source_program, kv_cache_dtype="fp8"):
    from helpers import ThreadWorkerGroup

    source = refit.EngineWorker("policy", 0, source_program,
                                engine_kwargs={"kv_cache_dtype": kv_cache_dtype, "num_layers": 2})
    destination = refit.EngineWorker("rollout", 0, Recorder(), framework="numpy")
    return ThreadWorkerGroup([source, destination]), destination.program


def test_an_engine_worker_sends_its_programs_kv_scales():
    group, recorder = driver_group(ScaledSource())
    try:
        sync = refit.WeightSynchronizer({"bucket_bytes": "1MiB", "timeout_s": 30}, group)
        for index in range(2):
            report = sync.sync_weights()
            assert report.destination_results[0]["stats"]["tensors"] == len(make_weights()) + 6
            scales = {name: float(t[0]) for name, t in recorder.got.items() if refit.is_kv_scale_name(name)}
            expected = {name: 1.0 for name in scale_names(2)}
            expected["model.layers.0.self_attn.k_scale"] = 0.5 + index
            expected["model.layers.1.self_attn.attn.q_scale"] = 4.0
            assert scales == expected
            assert hashes([(n, recorder.got[n]) for n, _ in make_weights(seed=index)]) == hashes(make_weights(seed=index))
    finally:
        group.close()


def test_without_kv_scales_an_fp8_worker_sends_ones():
    group, recorder = driver_group(ScaledSource(scales=False))
    try:
        refit.WeightSynchronizer({"bucket_bytes": "1MiB", "timeout_s": 30}, group).sync_weights()
        assert {float(recorder.got[name][0]) for name in scale_names(2)} == {1.0}
    finally:
        group.close()


def test_kv_scales_for_an_engine_without_fp8_fail_the_refit():
    group, _ = driver_group(ScaledSource(), kv_cache_dtype="auto")
    try:
        sync = refit.WeightSynchronizer({"bucket_bytes": "1MiB", "timeout_s": 5}, group)
        with pytest.raises(refit.InvalidArgumentError, match="kv_scales were given"):
            sync.sync_weights()
        assert sync.stale and not sync.ready
    finally:
        group.close()
