"""split_weight_chunks / merge_weight_chunk_batches: round trips through buckets, and the errors of
a chunk stream with gaps, overlaps or wrong sizes."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import refit
from refit import TensorMeta, merge_weight_chunk_batches, split_weight_chunks


def weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        ("big", rng.standard_normal(1000, dtype=np.float32)),                       # 4000 bytes
        ("bf16", rng.standard_normal((7, 3)).astype(ml_dtypes.bfloat16)),           # 42 bytes
        ("empty", np.zeros((0, 5), np.float16)),
        ("scalar", np.array(-1.25, np.float64)),
        ("mask", rng.integers(0, 2, 13).astype(np.bool_)),
        ("strided", rng.standard_normal((6, 8)).astype(np.float16)[:, ::3]),        # not contiguous
        ("fp8", rng.standard_normal(33).astype(ml_dtypes.float8_e4m3fn)),
        ("odd", rng.integers(-(1 << 40), 1 << 40, 5, dtype=np.int64)),              # 40 bytes
    ]


def buckets(chunks, bucket_size):
    """Packs chunks into buckets as the reference's sender does (aligned, flushed when full) and
    returns, per bucket, its (meta, view of the bucket) pairs: what a receiver gets."""
    out, metas, buf, off = [], [], np.zeros(bucket_size, np.uint8), 0

    def flush():
        nonlocal metas, buf, off
        out.append([(m, buf[m.offset:m.offset + m.chunk_size]) for m in metas])
        metas, buf, off = [], np.zeros(bucket_size, np.uint8), 0

    for meta, chunk in chunks:
        align = max(1, meta.itemsize)
        at = -(-off // align) * align
        if at + meta.chunk_size > bucket_size:
            flush()
            at = 0
        meta = dataclasses.replace(meta, offset=at)
        buf[at:at + meta.chunk_size] = chunk
        metas.append(meta)
        off = at + meta.chunk_size
    flush()
    return out


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == b.tobytes()


@pytest.mark.parametrize("bucket_size", [1, 3, 17, 64, 1000, 4000, 4096, 1 << 20])
def test_round_trip_through_buckets(bucket_size):
    sent = weights(bucket_size)
    got = {}
    for batch in merge_weight_chunk_batches(buckets(split_weight_chunks(sent, bucket_size), bucket_size)):
        assert batch, "a batch is never empty"
        for name, tensor in batch:
            assert name not in got
            got[name] = tensor
    expected = {name: t for name, t in sent if t.nbytes > 0}  # the reference drops zero-byte tensors
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert same(t, got[name]), name


def test_chunk_sizes_follow_the_bucket():
    w = [("a", np.zeros(10, np.float32)), ("b", np.zeros(3, np.uint8)), ("c", np.zeros(8, np.int8))]
    chunks = list(split_weight_chunks(w, 8))
    assert [(m.name, m.chunk_offset, m.chunk_size) for m, _ in chunks] == [
        ("a", 0, 8), ("a", 8, 8), ("a", 16, 8), ("a", 24, 8), ("a", 32, 8), ("b", 0, 3), ("c", 0, 8)]
    for meta, chunk in chunks:
        assert chunk.dtype == np.uint8 and chunk.size == meta.chunk_size
    m = chunks[0][0]
    assert m.shape == (10,) and m.dtype == np.float32 and m.nbytes == 40 and not m.whole
    assert chunks[-1][0].whole


def test_chunks_are_views_unless_the_tensor_was_not_contiguous():
    a = np.arange(12, dtype=np.int32)
    (meta, chunk), = split_weight_chunks([("a", a)], 1 << 10)
    a[0] = 77
    assert chunk.view(np.int32)[0] == 77
    s = np.arange(12, dtype=np.int32)[::2]
    (meta, chunk), = split_weight_chunks([("s", s)], 1 << 10)
    assert meta.shape == (6,) and chunk.view(np.int32).tolist() == [0, 2, 4, 6, 8, 10]


def test_a_tensor_over_many_chunks_merges_once_complete():
    t = np.random.default_rng(3).standard_normal((37, 11)).astype(ml_dtypes.bfloat16)  # 814 bytes
    chunks = list(split_weight_chunks([("t", t)], 5))
    assert len(chunks) == 163
    batches = [[c] for c in chunks]  # one chunk per bucket: 162 buckets complete nothing
    out = list(merge_weight_chunk_batches(batches))
    assert len(out) == 1 and out[0][0][0] == "t" and same(t, out[0][0][1])
    # owned: not a view of any chunk
    assert out[0][0][1].base is None or not np.shares_memory(out[0][0][1], chunks[-1][1])


def test_chunks_may_come_in_any_order_and_interleaved():
    rng = np.random.default_rng(4)
    a = rng.standard_normal(50).astype(np.float32)
    b = rng.integers(0, 255, 31).astype(np.uint8)
    chunks = list(split_weight_chunks([("a", a), ("b", b)], 9))
    order = rng.permutation(len(chunks))
    out = [p for batch in merge_weight_chunk_batches([[chunks[i]] for i in order]) for p in batch]
    assert sorted(n for n, _ in out) == ["a", "b"]
    assert same(a, dict(out)["a"]) and same(b, dict(out)["b"])


def test_whole_tensors_are_zero_copy_views_of_the_bucket():
    t = np.arange(6, dtype=np.int16).reshape(2, 3)
    bucket = buckets(split_weight_chunks([("t", t)], 64), 64)
    (batch,) = list(merge_weight_chunk_batches(bucket))
    name, view = batch[0]
    assert np.shares_memory(view, bucket[0][0][1]) and same(t, view)


def test_empty_tensors_are_dropped_unless_kept():
    w = [("e", np.zeros((0, 4), ml_dtypes.bfloat16)), ("x", np.ones(2, np.float32))]
    assert [m.name for m, _ in split_weight_chunks(w, 16)] == ["x"]
    chunks = list(split_weight_chunks(w, 16, keep_empty=True))
    assert [(m.name, m.chunk_size) for m, _ in chunks] == [("e", 0), ("x", 8)]
    (batch,) = list(merge_weight_chunk_batches([chunks]))
    assert [n for n, _ in batch] == ["e", "x"]
    assert batch[0][1].shape == (0, 4) and batch[0][1].dtype == ml_dtypes.bfloat16


def test_a_stream_of_nothing_merges_to_nothing():
    assert list(merge_weight_chunk_batches([[], []])) == []
    assert list(split_weight_chunks([], 4)) == []


def test_bad_arguments_to_split():
    with pytest.raises(refit.InvalidArgumentError, match="bucket_size must be >= 1"):
        list(split_weight_chunks([("a", np.zeros(1))], 0))
    with pytest.raises(refit.InvalidArgumentError, match="tensor 'obj'"):
        list(split_weight_chunks([("obj", object())], 4))


def meta(name="t", shape=(10,), dtype=np.float32, chunk_offset=0, chunk_size=40):
    return TensorMeta(name, shape, np.dtype(dtype), chunk_offset, chunk_size)


def data(n):
    return np.zeros(n, np.uint8)


def test_a_gap_is_reported_with_the_missing_bytes():
    batches = [[(meta(chunk_offset=0, chunk_size=16), data(16))], [(meta(chunk_offset=24, chunk_size=16), data(16))]]
    with pytest.raises(refit.ProtocolError, match=r"'t' \(32 of 40 bytes; missing \[16, 24\)\)"):
        list(merge_weight_chunk_batches(batches))


def test_a_truncated_stream_names_every_incomplete_tensor():
    batches = [[(meta("a", chunk_offset=0, chunk_size=8), data(8)),
                (meta("b", chunk_offset=32, chunk_size=8), data(8))]]
    with pytest.raises(refit.ProtocolError, match=r"'a' \(8 of 40 bytes; missing \[8, 40\)\); 'b' \(8 of 40 bytes; "
                                                  r"missing \[0, 32\)\)"):
        list(merge_weight_chunk_batches(batches))


def test_an_overlap_is_reported():
    batches = [[(meta(chunk_offset=0, chunk_size=16), data(16))], [(meta(chunk_offset=12, chunk_size=8), data(8))]]
    with pytest.raises(refit.ProtocolError, match=r"tensor 't': bytes \[12, 20\) overlap bytes \[0, 16\)"):
        list(merge_weight_chunk_batches(batches))
    # a whole copy of a tensor that is being merged overlaps too
    batches = [[(meta(chunk_offset=8, chunk_size=8), data(8)), (meta(), data(40))]]
    with pytest.raises(refit.ProtocolError, match=r"bytes \[0, 40\) overlap bytes \[8, 16\)"):
        list(merge_weight_chunk_batches(batches))


def test_size_mismatches_are_reported():
    with pytest.raises(refit.ProtocolError, match=r"tensor 't': the chunk at byte 8 has 7 bytes, its metadata says "
                                                  r"chunk_size=8"):
        list(merge_weight_chunk_batches([[(meta(chunk_offset=8, chunk_size=8), data(7))]]))
    with pytest.raises(refit.ProtocolError, match=r"tensor 't': chunk bytes \[36, 44\) fall outside its 40 bytes"):
        list(merge_weight_chunk_batches([[(meta(chunk_offset=36, chunk_size=8), data(8))]]))
    with pytest.raises(refit.ProtocolError, match="an empty chunk at byte 4"):
        list(merge_weight_chunk_batches([[(meta(chunk_offset=4, chunk_size=0), data(0))]]))
    with pytest.raises(refit.ProtocolError, match=r"tensor 't': a chunk says shape \(5,\)"):
        list(merge_weight_chunk_batches([[(meta(chunk_offset=0, chunk_size=8), data(8)),
                                          (meta(shape=(5,), chunk_offset=8, chunk_size=8), data(8))]]))


def test_errors_come_after_the_batches_before_them():
    good = (meta("ok", chunk_size=40), np.arange(40, dtype=np.uint8))
    bad = (meta("t", chunk_offset=0, chunk_size=8), data(8))
    it = merge_weight_chunk_batches([[good], [bad]])
    assert next(it)[0][0] == "ok"
    with pytest.raises(refit.ProtocolError, match="incomplete"):
        next(it)


def test_tensor_meta_is_frozen():
    m = meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.offset = 3  # type: ignore[misc]
    assert dataclasses.replace(m, offset=3).offset == 3 and m.whole


def test_torch_tensors_round_trip_when_torch_is_installed():
    torch = pytest.importorskip("torch")
    sent = [("w", torch.randn(9, 5, dtype=torch.bfloat16)), ("b", torch.arange(7, dtype=torch.int64)),
            ("t", torch.randn(4, 6)[:, ::2])]
    batches = [[c] for c in split_weight_chunks(sent, 11)]
    got = dict(p for batch in merge_weight_chunk_batches(batches) for p in batch)
    for name, t in sent:
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape)
        assert torch.equal(got[name], t.contiguous())
