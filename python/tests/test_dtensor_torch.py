"""refit.holdings_of against real torch DTensors (4 CPU ranks over gloo): for every placement
tried, the slice refit says a rank holds is exactly the rows torch put in its local shard. Runs
where PyTorch is installed (REFIT_TEST_TORCH=1 in scripts/test_python.sh)."""

import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port):
    import refit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mesh_shape, placements in [((2, 2), [Replicate(), Shard(0)]), ((2, 2), [Shard(0), Shard(0)]),
                                       ((4,), [Shard(0)]), ((4,), [Replicate()])]:
            mesh = init_device_mesh("cpu", mesh_shape)
            full = torch.arange(10.0).reshape(10, 1)  # row i holds i: the local shard shows its rows
            t = distribute_tensor(full, mesh, placements)
            local = t.to_local()
            request = refit.holdings_of({"w": t}).request_for("w")
            if request == ("whole",):
                start, length = 0, 10
            else:
                assert request[:2] == ("narrow", 0), request
                start, length = request[2], request[3]
            assert local.shape[0] == length, (mesh_shape, placements, rank, request, local.shape)
            if length:
                assert int(local[0, 0]) == start, (mesh_shape, placements, rank, request, local[:, 0].tolist())
            sent = dict(refit.local_tensors([("w", t)]))["w"]
            assert sent.shape == local.shape
    finally:
        dist.destroy_process_group()


def test_holdings_match_torch_dtensor_shards():
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(4, _free_port()), nprocs=4, join=True)
