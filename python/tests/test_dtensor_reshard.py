"""send_weights(model.state_dict()) of real torch DTensors, resharded: two ranks (processes over
gloo) each hold FSDP2's Shard(0) of every tensor as a DTensor built from its local shard, send only
that shard, and a destination in rank 0's process that holds the model at TP2 rank 0 (a vLLM
layout: column slices of q/k/v and the MLP's gate/up, row slices of o/down) gets exactly its slice
of the full tensors, bitwise, twice. On the host over UCX shared memory (CI, REFIT_TEST_TORCH=1), and
with CUDA tensors over CUDA IPC where a GPU is usable (scripts/gpu_python_test.sh)."""

import json
import os
import socket
import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

CONFIG = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16",
    "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
WORLD = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full_model(inventory, refit_round, device):
    """Every rank makes the same full tensors (a seed per round)."""
    generator = torch.Generator().manual_seed(1234 + refit_round)
    return {t.name: torch.randn(t.shape, generator=generator).to(torch.bfloat16).to(device)
            for t in inventory.tensors}


def _rank(rank, port, model_path, device, results):
    import refit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    engines = []
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        inventory = refit.load_model_inventory(model_path)
        config = {"timeout_s": 60, "device": "cuda" if device == "cuda" else "cpu",
                  "backend_name": "CUDA_IPC" if device == "cuda" else "UCX"}
        if device != "cuda":
            config["backend_init_params"] = {"tls": "posix,sysv,cma,self"}
        session = [refit.new_session_id() if rank == 0 else None]
        dist.broadcast_object_list(session, src=0)

        def state_dict(refit_round):
            # FSDP2's placement: Shard(0) of every tensor, built from the local rows without a collective.
            full = _full_model(inventory, refit_round, device)
            out = {}
            for name, value in full.items():
                rows = value.shape[0]
                start = min(rows, -(-rows // WORLD) * rank)
                stop = min(rows, start + -(-rows // WORLD))
                local = value[start:stop].contiguous()
                out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=value.shape,
                                               stride=value.stride())
            return full, out

        _, first = state_dict(0)
        source = refit.CheckpointEngine(1 << 20, config, session=session[0], holds=refit.holdings_of(first),
                                        model=model_path)
        engines.append(source)
        layout = refit.destination_layout(model_path, tp_size=2, tp_rank=0, shard_dense=True)
        destination = None
        if rank == 0:
            destination = refit.CheckpointEngine(1 << 20, config, session=session[0], model=model_path, layout=layout,
                                                 framework="torch")
            engines.append(destination)
        mine = [source.prepare(), destination.prepare() if destination else None]
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        metadata = [m[0] for m in everyone] + [everyone[0][1]]
        source.init_policy_process_group(rank, WORLD, 1, metadata)
        if destination:
            destination.init_rollout_process_group(0, WORLD, 1, metadata)
        for refit_round in range(2):
            full, shards = state_dict(refit_round)
            if device == "cuda":
                torch.cuda.synchronize()
            if not destination:
                source.send_weights(shards)
                dist.barrier()
                continue
            errors = []
            sender = threading.Thread(target=lambda: errors.extend(_send(source, shards)))
            sender.start()
            got = {}
            for batch in destination.receive_weight_batches():
                for name, tensor in batch:
                    got[name] = tensor.clone()
            sender.join()
            dist.barrier()
            assert not errors, errors
            for t in inventory.tensors:
                request = layout.request_for(t.name)
                expected = full[t.name]
                if request != ("whole",):
                    _, dim, start, length = request
                    expected = expected.narrow(dim, start, length)
                assert got[t.name].device.type == device, t.name
                assert torch.equal(got[t.name].cpu(), expected.cpu()), (refit_round, t.name, request)
            results.put((refit_round, len(got), sum(1 for t in inventory.tensors
                                                    if layout.request_for(t.name) != ("whole",))))
    finally:
        for e in engines:
            e.finalize()
        dist.destroy_process_group()


def _send(source, shards):
    try:
        source.send_weights(shards)
        return []
    except Exception as e:  # noqa: BLE001 (the receiving side reports it)
        return [e]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fsdp_dtensors_reshard_into_a_tp_destination(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: runs on a machine with a GPU (scripts/gpu_python_test.sh)")
    import torch.multiprocessing as mp

    model_path = str(tmp_path / "config.json")
    with open(model_path, "w") as f:
        json.dump(CONFIG, f)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(_free_port(), model_path, device, results), nprocs=WORLD, join=True,
                       start_method="spawn")
    import refit

    tensors = len(refit.load_model_inventory(model_path).tensors)
    rounds = sorted(results.get(timeout=5) for _ in range(2))
    # Both refits delivered every tensor, and the TP layout sliced most of them.
    assert rounds == [(0, tensors, rounds[0][2]), (1, tensors, rounds[0][2])]
    assert rounds[0][2] >= tensors // 2
