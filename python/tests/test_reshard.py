"""Resharding from Python: holdings from DTensor placements, the transfer plan, and engines whose
sources hold only their shards (in-process threads over UCX shared memory), checked bitwise."""

import json
import os
import threading

import numpy as np
import pytest

import refit

CONFIG = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "torch_dtype": "float32",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 500, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


class _Shard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self):
        return True

    def is_replicate(self):
        return False


class _Replicate:
    def is_shard(self):
        return False

    def is_replicate(self):
        return True


class _Mesh:
    def __init__(self, shape, coordinate):
        self.mesh = np.zeros(shape)
        self._coordinate = coordinate

    def get_coordinate(self):
        return self._coordinate


class FakeDTensor:
    """torch.distributed.tensor.DTensor's interface as refit reads it: global shape, placements,
    device mesh, to_local()."""

    def __init__(self, full, placements, mesh_shape, coordinate):
        self.shape = full.shape
        self.placements = placements
        self.device_mesh = _Mesh(mesh_shape, coordinate)
        request = refit._refit.dtensor_request("t", list(full.shape), [
            ("shard", p.dim) if p.is_shard() else ("replicate",) for p in placements], list(mesh_shape),
            list(coordinate))
        self._local = full if request == ("whole",) else np.take(
            full, range(request[2], request[2] + request[3]), axis=request[1])

    def to_local(self):
        return self._local


def test_holdings_follow_dtensor_placements_as_torch_shards():
    full = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    # HSDP: replicated over mesh dim 0, Shard(0) over mesh dim 1 of size 4: chunks of ceil(10 / 4) = 3.
    t = FakeDTensor(full, [_Replicate(), _Shard(0)], (2, 4), (1, 3))
    holds = refit.holdings_of({"w": t, "b": np.zeros(3, np.float32)})
    assert holds.request_for("w") == ("narrow", 0, 9, 1)
    assert holds.request_for("b") == ("whole",)
    assert [name for name, _ in refit.local_tensors([("w", t)])] == ["w"]
    assert next(refit.local_tensors([("w", t)]))[1].shape == (1, 6)
    two_dims = FakeDTensor(full, [_Shard(0), _Replicate()], (2, 2), (0, 0))
    two_dims.placements = [_Shard(0), _Shard(1)]  # a layout narrows one dim per tensor
    with pytest.raises(refit.LayoutError, match="sharded along dims 0 and 1"):
        refit.holdings_of({"w": two_dims})


def test_plan_names_a_slice_nobody_holds(model_path):
    inventory = refit.load_model_inventory(model_path)
    holds = refit.megatron_source_layouts(model_path, tp=2)
    plan = refit.plan_transfers(inventory, holds, [refit.Layout()])
    assert plan.sources_of(0) == [0, 1]
    assert sum(plan.egress) == sum(plan.ingress) == inventory.total_bytes
    with pytest.raises(refit.LayoutError, match="no source holds"):
        refit.plan_transfers(inventory, holds[:1], [refit.Layout()])


def _fsdp_group(model_path, inventory, world, config):
    """`world` FSDP sources (each holding Shard(0) of every tensor, as DTensors would give it) and one
    whole destination, connected over UCX."""
    session = refit.new_session_id()
    sources = [refit.CheckpointEngine(1 << 16, config, session=session, model=model_path,
                                      holds=refit.holdings_of(_fsdp_shards({t.name: np.zeros(t.shape, np.float32)
                                                                            for t in inventory.tensors}, world, r)))
               for r in range(world)]
    destination = refit.CheckpointEngine(1 << 16, config, session=session, model=inventory)
    metadata = [e.prepare() for e in sources] + [destination.prepare()]
    for rank, e in enumerate(sources):
        e.init_policy_process_group(rank, world, 1, metadata)
    destination.init_rollout_process_group(0, world, 1, metadata)
    return sources, destination


def _fsdp_shards(full, world, rank):
    return {name: FakeDTensor(value, [_Shard(0)], (world,), (rank,)) for name, value in full.items()}


def _refit_bitwise(sources, destination, full):
    """One refit of `full`, each source sending its shards from a thread of its own; the destination
    must end with every tensor bitwise. Returns each source's send stats and the receive stats."""
    errors, sent = [], [None] * len(sources)

    def send(rank):
        try:
            sent[rank] = sources[rank].send_weights(_fsdp_shards(full, len(sources), rank).items())
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(len(sources))]
    for t in threads:
        t.start()
    got = {}
    batches = destination.receive_weight_batches(framework="numpy")
    for batch in batches:
        for name, tensor in batch:
            got[name] = np.array(tensor, copy=True)
    for t in threads:
        t.join()
    assert not errors
    assert set(got) == set(full)
    for name, value in full.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    return sent, batches.stats


def test_fsdp_sources_refit_a_whole_destination_bitwise(model_path):
    inventory = refit.load_model_inventory(model_path)
    rng = np.random.default_rng(3)
    full = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in inventory.tensors}
    config = {"timeout_s": 20, "backend_init_params": {"tls": "posix,sysv,cma,self"}}
    sources, destination = _fsdp_group(model_path, inventory, 3, config)
    _refit_bitwise(sources, destination, full)
    for e in sources + [destination]:
        e.finalize()


def test_fsdp_sources_send_only_the_changes_of_their_shards_with_delta(model_path):
    """Delta refit when resharding: each FSDP rank's link carries the changed elements of its
    pieces after the first refit, and the destination ends bitwise equal to the full weights."""
    inventory = refit.load_model_inventory(model_path)
    rng = np.random.default_rng(5)
    full = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in inventory.tensors}
    config = {"timeout_s": 20, "delta": True, "backend_init_params": {"tls": "tcp,self"}}
    sources, destination = _fsdp_group(model_path, inventory, 2, config)
    sent, received = _refit_bitwise(sources, destination, full)
    assert received["delta_tensors"] == 0  # no base yet: every piece whole
    full_wire = received["wire_bytes"]
    for step in range(3):
        for value in full.values():  # an optimizer step as bits see it: 1% of the elements move
            bits = value.reshape(-1).view(np.uint32)
            bits[rng.choice(bits.size, max(1, bits.size // 100), replace=False)] += 1
        sent, received = _refit_bitwise(sources, destination, full)
        assert received["delta_tensors"] > 0, step
        assert sum(s["delta_tensors"] for s in sent) == received["delta_tensors"]
        assert received["wire_bytes"] < full_wire / 5, (step, received["wire_bytes"], full_wire)
        assert received["delta_seconds"] > 0
    for e in sources + [destination]:
        e.finalize()
