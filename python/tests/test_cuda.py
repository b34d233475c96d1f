"""GPU tensors in and out: PyTorch CUDA tensors and CuPy arrays as sources, torch tensors received,
and the Ray example's programs with torch CUDA tensors over a process group. Skipped without
PyTorch and a GPU (as on CI here); run on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest

import refit
from refit.multiprocessing_group import ProcessWorkerGroup
from refit.testing import SyntheticPrograms, verify

from helpers import TINY_MOE, Pair

torch = pytest.importorskip("torch", reason="PyTorch is not installed (GPU tests run on a machine with a GPU)")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU tests run on a machine with a GPU", allow_module_level=True)

MiB = 1 << 20


def test_torch_cuda_tensors_in_and_torch_tensors_out():
    weights = [("bf16", torch.randn(333, 17, device="cuda").to(torch.bfloat16)),
               ("f32", torch.randn(1000, device="cuda")),
               ("t", torch.randn(64, 48, device="cuda").t()),  # non-contiguous
               ("big", torch.arange(MiB, dtype=torch.float32, device="cuda")),  # 4 MiB: merged
               ("grad", torch.randn(10, device="cuda", requires_grad=True)),
               ("empty", torch.empty(0, 4, device="cuda"))]
    torch.cuda.synchronize()
    pair = Pair(MiB, framework="torch")
    try:
        got = {}
        pair.refit(weights, lambda b: got.update({n: t.clone() for n, t in b}))
        for name, t in weights:
            expected = t.detach().contiguous().cpu()
            assert isinstance(got[name], torch.Tensor) and got[name].dtype == t.dtype
            assert got[name].shape == t.shape
            assert torch.equal(got[name].cpu(), expected), name
    finally:
        pair.close()


def test_cupy_arrays_in():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    a = cupy.arange(12345, dtype=cupy.int32)
    b = cupy.ones((7, 9), dtype=cupy.float16)
    pair = Pair(MiB, framework="numpy")
    try:
        got = {}
        pair.refit([("a", a), ("b", b)], lambda batch: got.update({n: t.copy() for n, t in batch}))
        assert np.array_equal(got["a"], cupy.asnumpy(a)) and np.array_equal(got["b"], cupy.asnumpy(b))
    finally:
        pair.close()


def test_process_group_with_torch_cuda_programs():
    programs = SyntheticPrograms(TINY_MOE, backend="torch", device="cuda")
    with ProcessWorkerGroup(2, 2, programs, framework="torch") as group:
        sync = refit.WeightSynchronizer({"bucket_bytes": "32MiB", "timeout_s": 120}, group)
        for _ in range(2):
            report = sync.sync_weights()
            assert verify(report.results, 2) == []
