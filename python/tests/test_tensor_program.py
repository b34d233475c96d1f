"""refit.TensorProgram, the program that is only the named tensors a worker holds: a source sends
them, a destination copies what it receives into them by name, refusing another dtype or shape and
naming the tensors no source sent; a program factory may return one, or just the mapping."""

from __future__ import annotations

import re

import numpy as np
import pytest

import refit
from refit.multiprocessing_group import ProcessWorkerGroup

from helpers import ThreadWorkerGroup

CONFIG = {"bucket_bytes": "1MiB", "timeout_s": 30}


def tensors(role: str, rank: int) -> dict:
    """A program as a mapping: what the worker holds, the source's content, zeros at a destination."""
    source = role == "policy"
    return {
        "w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512) * (1 if source else 0),  # 1 MiB: two buckets
        "ids": np.full(7, 42 if source else 0, np.int64),
        "empty": np.zeros(0, np.float32),
    }


def hashing_program(role: str, rank: int) -> refit.TensorProgram:
    """The same tensors, reporting the hash of each."""
    held = tensors(role, rank)
    return refit.TensorProgram(held, report=lambda: {name: refit.xxh3_64(t) for name, t in held.items()})


def group_of(source, destination) -> ThreadWorkerGroup:
    return ThreadWorkerGroup([refit.EngineWorker("policy", 0, source), refit.EngineWorker("rollout", 0, destination)])


def test_a_mapping_program_refits_between_processes_and_reports_its_counts():
    with ProcessWorkerGroup(1, 1, tensors) as group:
        sync = refit.WeightSynchronizer(CONFIG, group)
        for _ in range(2):
            report = sync.sync_weights()
            for result in report.results:
                assert result["report"] == {"tensors": 3, "bytes": (1 << 20) + 56}
            assert report.destination_results[0]["stats"]["tensors"] == 3


def test_a_tensor_program_refits_between_processes_and_the_destination_holds_the_source_bytes():
    with ProcessWorkerGroup(1, 1, hashing_program) as group:
        report = refit.WeightSynchronizer(CONFIG, group).sync_weights()
    sent, held = report.source_results[0]["report"], report.destination_results[0]["report"]
    assert held == sent
    assert held["w"] == refit.xxh3_64(tensors("policy", 0)["w"]) != refit.xxh3_64(tensors("rollout", 0)["w"])


def test_the_destination_writes_into_the_callers_arrays_in_place():
    held = tensors("rollout", 0)
    w = held["w"]
    group = group_of(tensors("policy", 0), held)
    try:
        refit.WeightSynchronizer(CONFIG, group).sync_weights()
    finally:
        group.close()
    assert held["w"] is w
    assert np.array_equal(w, tensors("policy", 0)["w"]) and np.all(held["ids"] == 42)


def test_a_destination_of_another_dtype_or_shape_fails_the_refit_naming_the_tensor():
    other_shape = {**tensors("rollout", 0), "w": np.zeros((256, 1024), np.float32)}
    other_dtype = {**tensors("rollout", 0), "ids": np.zeros(7, np.int32)}
    for held, says in [(other_shape, "received tensor 'w' is float32 [512, 512] but its parameter here is float32 "
                                     "[256, 1024]"),
                       (other_dtype, "received tensor 'ids' is int64 [7] but its parameter here is int32 [7]")]:
        group = group_of(tensors("policy", 0), held)
        try:
            # The source raises first (sources come first), naming what its destination said, with
            # the destination's error class.
            with pytest.raises(refit.LayoutError, match=re.escape(says)):
                refit.WeightSynchronizer(CONFIG, group).sync_weights()
        finally:
            group.close()


def test_a_tensor_that_no_source_sent_fails_the_refit_naming_it():
    held = {**tensors("rollout", 0), "lm_head.weight": np.zeros(3, np.float32)}
    group = group_of(tensors("policy", 0), held)
    try:
        sync = refit.WeightSynchronizer(CONFIG, group)
        with pytest.raises(refit.LayoutError,
                           match=r"refit 0: no source sent 1 of the 4 tensors this destination holds "
                                 r"\('lm_head.weight'\); they still hold their old bytes"):
            sync.sync_weights()
        assert sync.stale
    finally:
        group.close()


def test_the_missing_list_names_five_tensors_and_counts_the_rest():
    program = refit.TensorProgram({f"t{i}": np.zeros(1, np.uint8) for i in range(8)})
    program.stage(0)
    program.loader(0)  # a destination whose refit brought nothing
    with pytest.raises(refit.LayoutError, match=r"\('t0', 't1', 't2', 't3', 't4' and 3 more\)"):
        program.report(0)
    program.loader(1)
    program.stage(1)  # a refit that failed before its report does not count for the next
    program.loader(1)
    with pytest.raises(refit.LayoutError, match="no source sent 8 of the 8"):
        program.report(1)


def test_tensors_given_twice_or_not_as_pairs_are_refused():
    with pytest.raises(refit.InvalidArgumentError, match="tensor 'w' was given twice"):
        refit.TensorProgram([("w", np.zeros(2)), ("w", np.zeros(2))])
    with pytest.raises(refit.InvalidArgumentError, match="expected a mapping or .name, tensor. pairs"):
        refit.TensorProgram([np.zeros(2)])


def test_weight_specs_and_the_default_report_read_no_data():
    program = refit.TensorProgram([("a", np.zeros((2, 3), np.float16)), ("b", np.zeros(5, np.uint8))])
    assert program.weight_specs(0) == [("a", "float16", (2, 3)), ("b", "uint8", (5,))]
    assert program.report(0) == {"tensors": 2, "bytes": 17}  # a source: nothing to check


def test_a_tensor_program_receives_through_its_loader_not_an_iterator():
    refit.EngineWorker("policy", 0, tensors("policy", 0), receive="iterator")  # a source receives nothing
    with pytest.raises(refit.InvalidArgumentError, match="destination rank 3: .* receive='callback', not 'iterator'"):
        refit.EngineWorker("rollout", 3, tensors("rollout", 3), receive="iterator")


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    source = {"w": torch.arange(1000, dtype=torch.bfloat16), "b": torch.ones(3, 4)}
    held = {"w": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(3, 4)}
    group = group_of(refit.TensorProgram(source), refit.TensorProgram(held))
    try:
        refit.WeightSynchronizer(CONFIG, group).sync_weights()
    finally:
        group.close()
    assert torch.equal(held["w"], source["w"]) and torch.equal(held["b"], source["b"])
