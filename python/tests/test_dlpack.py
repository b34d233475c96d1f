"""Tensors in and out by DLPack: NumPy (with ml_dtypes for bfloat16/float8), the bare DLPack
object, PyTorch when it is installed; dtypes, shapes, zero-size tensors, contiguity, layouts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import refit

from helpers import Pair

MiB = 1 << 20

DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64,
          ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("framework", ["numpy", "dlpack"])
def test_every_dtype_round_trips(framework):
    weights = [(f"t.{np.dtype(d).name}", sample(d, (3, 5, 7), i)) for i, d in enumerate(DTYPES)]
    pair = Pair(MiB, framework=framework)
    try:
        got = {}

        def load(batch):
            for name, t in batch:
                if framework == "dlpack":
                    assert hasattr(t, "__dlpack__") and t.__dlpack_device__()[0] == 1  # kDLCPU
                    info = refit.tensor_info(t)
                    got[name] = (refit.xxh3_64(t), info[0], info[1])
                else:
                    assert isinstance(t, np.ndarray)
                    got[name] = (refit.xxh3_64(t), t.dtype.name, t.shape)

        pair.refit(weights, load)
        for name, t in weights:
            h, dtype, shape = got[name]
            assert h == refit.xxh3_64(t) and tuple(shape) == t.shape
            assert dtype == np.dtype(t.dtype).name
    finally:
        pair.close()


def test_numpy_from_dlpack_of_a_received_tensor():
    pair = Pair(MiB, framework="dlpack")
    try:
        out = {}
        pair.refit([("x", np.arange(12, dtype=np.int32).reshape(3, 4))],
                   lambda b: out.update({n: np.from_dlpack(t).copy() for n, t in b}))
        assert np.array_equal(out["x"], np.arange(12, dtype=np.int32).reshape(3, 4))
    finally:
        pair.close()


def test_zero_size_and_scalar_tensors_are_delivered():
    weights = [("empty", np.zeros((0,), np.float32)), ("empty2d", np.zeros((4, 0), ml_dtypes.bfloat16)),
               ("scalar", np.array(7, np.int64)), ("after", np.ones(3, np.float16))]
    pair = Pair(MiB)
    try:
        got = {}
        pair.refit(weights, lambda b: got.update({n: t.copy() for n, t in b}))
        assert list(got) == [n for n, _ in weights]
        assert got["empty"].shape == (0,) and got["empty2d"].shape == (4, 0)
        assert got["empty2d"].dtype == ml_dtypes.bfloat16
        assert got["scalar"].shape == () and got["scalar"] == 7
    finally:
        pair.close()


def test_non_contiguous_numpy_is_made_contiguous():
    base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    weights = [("t", base.T), ("s", base[::3, 1::2]), ("f", np.asfortranarray(base[:10, :10]))]
    pair = Pair(MiB)
    try:
        got = {}
        pair.refit(weights, lambda b: got.update({n: t.copy() for n, t in b}))
        for name, t in weights:
            assert np.array_equal(got[name], t) and got[name].shape == t.shape
    finally:
        pair.close()


def test_a_non_contiguous_object_without_a_way_to_copy_is_refused():
    class Strided:
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, *args, **kwargs):
            return self._a.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    pair = Pair(MiB)
    try:
        sender = pair.start_send([("odd", Strided(np.arange(10.0)[::2]))])
        with pytest.raises(refit.RefitError):
            for _ in pair.destination.receive_weight_batches():
                pass
        with pytest.raises(refit.InvalidArgumentError,
                           match=r"tensor 'odd' \(.*Strided\) is not contiguous \(shape \[5\], strides \[2\]\)"):
            sender.join()
    finally:
        pair.close()


def test_layouts_narrow_and_drop_on_the_source():
    layout = refit.Layout({"w": ("narrow", 1, 2, 3), "gone": "drop"}, drop_prefixes=["skip."])
    assert layout.request_for("w") == ("narrow", 1, 2, 3)
    assert layout.request_for("skip.x") == ("drop",)
    assert refit.Layout.from_bytes(layout.to_bytes()) == layout
    w = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
    weights = [("w", w), ("gone", np.ones(3)), ("skip.x", np.ones(2)), ("kept", np.ones(5, np.int8))]
    pair = Pair(MiB, layout=layout)
    try:
        assert pair.source.get_target_weight_layout() == layout
        got = {}
        sstats, _ = pair.refit(weights, lambda b: got.update({n: t.copy() for n, t in b}))
        assert sorted(got) == ["kept", "w"]
        assert np.array_equal(got["w"], w[:, 2:5])
        assert sstats["dropped"] == 2
    finally:
        pair.close()


def test_tensor_info_and_hash_helpers():
    a = np.zeros((2, 3), ml_dtypes.bfloat16)
    assert refit.tensor_info(a) == ("bfloat16", (2, 3), 12)
    b = np.zeros(16, np.uint8)
    refit.fill_synthetic(b, 7)
    assert b.any() and refit.xxh3_64(b) == refit.xxh3_64(b.copy())


def test_torch_tensors_when_torch_is_installed():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (its PyPI wheels are too large for CI here)")
    weights = [("bf16", torch.randn(33, 17).to(torch.bfloat16)), ("f32", torch.randn(1000)),
               ("grad", torch.randn(10, requires_grad=True)), ("t", torch.randn(8, 6).t()),
               ("big", torch.arange(MiB, dtype=torch.float32)), ("i64", torch.arange(5))]
    pair = Pair(MiB, framework="torch")
    try:
        got = {}
        pair.refit(weights, lambda b: got.update({n: t.clone() for n, t in b}))
        for name, t in weights:
            assert isinstance(got[name], torch.Tensor) and got[name].dtype == t.dtype
            assert torch.equal(got[name], t.detach().contiguous())
    finally:
        pair.close()
