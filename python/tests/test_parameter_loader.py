"""refit.ParameterLoader: receive_weights(loader) copies every tensor into the destination's own
parameters in C++, by name, with no Python object per tensor; what has no parameter (or another
size) fails the refit, naming the tensor."""

from __future__ import annotations

import re

import numpy as np
import pytest

import refit

from helpers import Pair

MiB = 1 << 20


def weights(refit_index: int):
    rng = np.random.default_rng(refit_index)
    out = [(f"layers.{i}.w", rng.standard_normal(1000 + 37 * i).astype(np.float32)) for i in range(30)]
    out.append(("embed", rng.standard_normal(MiB // 2).astype(np.float32)))  # split over 1 MiB buckets
    out.append(("empty", np.zeros(0, np.float32)))
    return out


def test_received_tensors_land_in_their_parameters_over_refits():
    pair = Pair(MiB)
    try:
        parameters = {name: np.zeros_like(t) for name, t in weights(0)}
        loader = refit.ParameterLoader(parameters)
        assert len(loader) == len(parameters)
        for r in range(3):
            sent = weights(r)
            sender = pair.start_send(sent)
            stats = pair.destination.receive_weights(loader)
            sender.join()
            assert stats["tensors"] == len(sent)
            for name, t in sent:
                assert np.array_equal(parameters[name], t), (name, r)
        assert loader.tensors_loaded == 3 * len(parameters)
        assert loader.bytes_loaded == 3 * sum(t.nbytes for _, t in weights(0))
        assert not pair.destination.stale
    finally:
        pair.close()


def test_a_tensor_without_a_parameter_fails_the_refit_naming_it():
    pair = Pair(MiB)
    try:
        sent = weights(1)
        parameters = [(name, np.zeros_like(t)) for name, t in sent if name != "layers.7.w"]  # pairs work too
        loader = refit.ParameterLoader(parameters)
        sender = pair.start_send(sent)
        with pytest.raises(refit.LayoutError, match="received tensor 'layers.7.w' has no parameter here"):
            pair.destination.receive_weights(loader)
        with pytest.raises(refit.RefitError):
            sender.join()
        assert pair.destination.stale
    finally:
        pair.close()


@pytest.mark.parametrize("parameter,message", [
    (np.zeros((64, 128), np.float32), "received tensor 'w' is float32 [128, 64] but its parameter here is float32 [64, 128]"),
    (np.zeros((128, 64), np.int32), "received tensor 'w' is float32 [128, 64] but its parameter here is int32 [128, 64]"),
])
def test_a_tensor_of_another_dtype_or_shape_is_refused_though_its_bytes_would_fit(parameter, message):
    pair = Pair(MiB)
    try:
        loader = refit.ParameterLoader({"w": parameter})
        sender = pair.start_send([("w", np.ones((128, 64), np.float32))])
        with pytest.raises(refit.LayoutError, match=re.escape(message)):
            pair.destination.receive_weights(loader)
        with pytest.raises(refit.RefitError):
            sender.join()
        assert not parameter.any()  # nothing was written
    finally:
        pair.close()


def test_parameters_must_be_writable_contiguous_tensors():
    with pytest.raises(refit.InvalidArgumentError, match="parameter 'w'.*contiguous"):
        refit.ParameterLoader({"w": np.zeros((4, 4), np.float32)[:, 1]})
    with pytest.raises(refit.InvalidArgumentError, match="expected a mapping or \\(name, tensor\\) pairs"):
        refit.ParameterLoader([np.zeros(3)])
    with pytest.raises(refit.InvalidArgumentError, match="parameter 'w' was added twice"):
        refit.ParameterLoader([("w", np.zeros(3)), ("w", np.zeros(3))])


def test_torch_parameters_that_require_grad_are_written_in_place():
    torch = pytest.importorskip("torch")
    pair = Pair(MiB)
    try:
        model = torch.nn.Linear(64, 32)
        sent = [(name, np.random.default_rng(3).standard_normal(tuple(p.shape)).astype(np.float32))
                for name, p in model.named_parameters()]
        loader = refit.ParameterLoader(model.named_parameters())
        sender = pair.start_send(sent)
        pair.destination.receive_weights(loader)
        sender.join()
        for name, t in sent:
            assert np.array_equal(dict(model.named_parameters())[name].detach().numpy(), t), name
    finally:
        pair.close()


def test_a_tensor_set_is_read_once_and_sends_what_its_tensors_hold_now():
    """refit.TensorSet on the source: each send streams the same tensors from C++; updates made in
    place between sends are what the next refit delivers."""
    pair = Pair(MiB)
    try:
        source_tensors = dict(weights(5))
        tensor_set = refit.TensorSet(source_tensors)
        assert len(tensor_set) == len(source_tensors)
        parameters = {name: np.zeros_like(t) for name, t in source_tensors.items()}
        loader = refit.ParameterLoader(parameters)
        for r in range(3):
            for t in source_tensors.values():
                t += 1  # the training step, in place
            sender = pair.start_send(tensor_set)
            pair.destination.receive_weights(loader)
            stats = sender.join()
            assert stats["tensors"] == len(source_tensors)
            for name, t in source_tensors.items():
                assert np.array_equal(parameters[name], t), (name, r)
    finally:
        pair.close()


def test_a_tensor_set_reads_tensors_where_they_lie():
    with pytest.raises(refit.InvalidArgumentError, match="tensor 'w' is not contiguous"):
        refit.TensorSet({"w": np.zeros((4, 4), np.float32)[:, 1]})
    with pytest.raises(refit.InvalidArgumentError, match="expected a mapping or \\(name, tensor\\) pairs"):
        refit.TensorSet([("w",)])


def test_the_loader_says_which_parameters_no_source_sent():
    pair = Pair(MiB)
    try:
        sent = weights(1)
        loader = refit.ParameterLoader({name: np.zeros_like(t) for name, t in sent})
        some = sent[:3]
        sender = pair.start_send(some)
        pair.destination.receive_weights(loader)
        sender.join()
        assert loader.take_not_loaded() == [name for name, _ in sent[3:]]
        assert len(loader.take_not_loaded()) == len(sent)  # counted anew
    finally:
        pair.close()


def test_parameters_share_memory_only_as_one_tied_tensor():
    # A tied model's state_dict names one tensor twice: both names load, and must bring the same
    # bytes; an untied source into it fails the refit naming both. Parameters that overlap in any
    # other way are refused when the loader is made.
    torch = pytest.importorskip("torch")
    buffer = torch.zeros(2400)
    with pytest.raises(refit.InvalidArgumentError, match="'lm_head' .* overlaps the memory of parameter 'embed'"):
        refit.ParameterLoader({"embed": buffer[:1600].view(100, 16), "lm_head": buffer[800:].view(100, 16)})
    pair = Pair(MiB)
    try:
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(100, 16)
        model.lm_head = torch.nn.Linear(16, 100, bias=False)
        model.lm_head.weight = model.embed.weight  # tied, as transformers ties them
        parameters = model.state_dict()
        assert parameters["embed.weight"].data_ptr() == parameters["lm_head.weight"].data_ptr()
        loader = refit.ParameterLoader(parameters)
        rng = np.random.default_rng(5)
        for r in range(2):
            embed = rng.standard_normal((100, 16)).astype(np.float32)
            sender = pair.start_send([("embed.weight", embed), ("lm_head.weight", embed.copy())])
            pair.destination.receive_weights(loader)
            sender.join()
            assert np.array_equal(model.embed.weight.detach().numpy(), embed), r
        untied = [("embed.weight", rng.standard_normal((100, 16)).astype(np.float32)),
                  ("lm_head.weight", rng.standard_normal((100, 16)).astype(np.float32))]
        sender = pair.start_send(untied)
        with pytest.raises(refit.LayoutError, match="'embed.weight' and 'lm_head.weight' differ, but their parameters "
                                                    "here are one memory"):
            pair.destination.receive_weights(loader)
        with pytest.raises(refit.RefitError):
            sender.join()
        assert not np.array_equal(model.embed.weight.detach().numpy(), untied[1][1])
    finally:
        pair.close()
