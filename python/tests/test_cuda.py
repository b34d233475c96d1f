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


def test_in_place_sends_are_loaded_straight_from_the_source_tensors():
    """send_weights(in_place=True) over CUDA IPC: the destination loads each tensor from the
    source's own memory (direct_reads), one copy per byte. A strided view goes in place too: its
    contiguous copy is kept alive for the send as well."""
    from helpers import config

    weights = [(f"layer{i}", torch.randn(1024, 257, device="cuda")) for i in range(6)]
    weights.append(("strided", torch.randn(64, 48, device="cuda").t()))
    torch.cuda.synchronize()
    pair = Pair(4 * MiB, config(backend_name="CUDA_IPC", device="cuda"), framework="torch")
    try:
        for in_place in (True, False):
            got = {}
            send_stats, receive_stats = pair.refit(weights, lambda b: got.update({n: t.clone() for n, t in b}),
                                                   send_kwargs={"in_place": in_place})
            for name, t in weights:
                assert torch.equal(got[name], t.contiguous()), name
            total = sum(t.numel() * t.element_size() for _, t in weights)
            assert send_stats["payload_bytes"] == receive_stats["payload_bytes"] == total
            assert send_stats["in_place_bytes"] == receive_stats["in_place_bytes"] == (total if in_place else 0)
    finally:
        pair.close()


def test_a_parameter_loader_loads_gpu_parameters_over_cuda_ipc():
    """refit.ParameterLoader with a model's CUDA parameters (they require grad): every tensor read
    in place from the source's GPU memory and copied by the loader's kernel, bitwise, twice."""
    from helpers import config

    model = torch.nn.Sequential(*[torch.nn.Linear(257, 129) for _ in range(8)]).cuda()
    pair = Pair(4 * MiB, config(backend_name="CUDA_IPC", device="cuda"), framework="torch")
    try:
        loader = refit.ParameterLoader(model.named_parameters())
        for r in range(2):
            sent = [(name, torch.randn(p.shape, device="cuda")) for name, p in model.named_parameters()]
            torch.cuda.synchronize()
            sender = pair.start_send(sent, in_place=True)
            stats = pair.destination.receive_weights(loader)
            send_stats = sender.join()
            assert stats["in_place_bytes"] == send_stats["payload_bytes"] > 0
            params = dict(model.named_parameters())
            for name, t in sent:
                assert torch.equal(params[name].detach(), t), (name, r)
        assert loader.tensors_loaded == 2 * len(loader)
    finally:
        pair.close()


def test_a_tensor_set_of_gpu_parameters_goes_in_place():
    """refit.TensorSet of a model's CUDA parameters: every send reads them in place over CUDA IPC,
    with no Python call per tensor, and sees the updates made between sends."""
    from helpers import config

    source = torch.nn.Sequential(*[torch.nn.Linear(129, 65) for _ in range(6)]).cuda()
    target = torch.nn.Sequential(*[torch.nn.Linear(129, 65) for _ in range(6)]).cuda()
    pair = Pair(4 * MiB, config(backend_name="CUDA_IPC", device="cuda"), framework="torch")
    try:
        tensor_set = refit.TensorSet(source.named_parameters())
        loader = refit.ParameterLoader(target.named_parameters())
        for _ in range(2):
            with torch.no_grad():
                for p in source.parameters():
                    p.add_(1.0)
            torch.cuda.synchronize()
            sender = pair.start_send(tensor_set)
            stats = pair.destination.receive_weights(loader)
            send_stats = sender.join()
            assert stats["in_place_bytes"] == send_stats["payload_bytes"] > 0
            for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
                assert torch.equal(a, b), name
    finally:
        pair.close()
