"""Resharding from where the weights live: a source declares what it holds (its shards) instead of
gathering full tensors, and every destination reads its slices from the sources that have them.

With torch DTensors (FSDP2, tensor parallelism by DeviceMesh placements) nothing is written by
hand: ``holdings_of(model.state_dict())`` reads each tensor's placements, and
``CheckpointEngine.send_weights`` sends each DTensor's local shard::

    holds = refit.holdings_of(model.state_dict())
    engine = refit.CheckpointEngine(bucket, config, holds=holds, model="path/to/config.json", ...)
    ...
    engine.send_weights(model.state_dict().items())      # local shards, no full_tensor()

For Megatron-style training, ``refit.megatron_source_layouts(config_path, tp=, pp=, dp=, ep=)``
gives every rank's holdings; ``refit.plan_transfers`` shows the plan before anything moves.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping, Tuple

from . import _refit
from ._refit import Layout


def is_dtensor(value: Any) -> bool:
    """A torch.distributed.tensor.DTensor (duck-typed, so torch is imported only by its users)."""
    return hasattr(value, "placements") and hasattr(value, "device_mesh") and hasattr(value, "to_local")


def _placement(name: str, placement: Any) -> tuple:
    if hasattr(placement, "is_shard") and placement.is_shard():
        return ("shard", int(placement.dim))
    if hasattr(placement, "is_replicate") and placement.is_replicate():
        return ("replicate",)
    raise _refit.LayoutError(
        f"tensor '{name}': placement {placement!r} cannot be refit as is (a Partial tensor must be reduced first)")


def dtensor_request(name: str, tensor: Any) -> tuple:
    """What this rank holds of DTensor ``tensor``: ('whole',) or ('narrow', dim, start, length)."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise _refit.LayoutError(f"tensor '{name}': this rank is not in the tensor's device mesh")
    return _refit.dtensor_request(name, list(tensor.shape), [_placement(name, p) for p in tensor.placements],
                                  list(mesh.mesh.shape), list(coordinate))


def holdings_of(state_dict: Mapping[str, Any]) -> Layout:
    """This rank's holdings (a source layout) from a state dict: a DTensor holds what its
    placements give this rank; any other tensor is held whole. Raises LayoutError for a placement
    refit cannot express (Partial; Shard of two different dims of one tensor)."""
    entries = {}
    for name, value in state_dict.items():
        if is_dtensor(value):
            request = dtensor_request(name, value)
            if request != ("whole",):
                entries[name] = request
    return Layout(entries)


def local_tensors(weights: Iterable[Tuple[str, Any]]) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs with every DTensor replaced by its local shard (no gather)."""
    for item in weights:
        # Anything but a (name, DTensor) pair goes on unchanged: the engine names a malformed item.
        if isinstance(item, tuple) and len(item) == 2 and is_dtensor(item[1]):
            yield item[0], item[1].to_local()
        else:
            yield item
