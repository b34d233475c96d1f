#!/usr/bin/env python3
"""refit driven by Ray: a driver with policy actors (sources) and rollout actors (destinations)
runs refits of a model and checks every tensor of every refit bitwise (XXH3-64 per tensor).

    python python/examples/ray_refit.py                      # 2 + 2 actors, 3 refits, CPU, NumPy
    python python/examples/ray_refit.py --device cuda        # PyTorch CUDA tensors (needs torch, GPUs)
    python python/examples/ray_refit.py --address auto       # on a running Ray cluster

The driver uses refit.WeightSynchronizer over refit.ray.RayWorkerGroup, a refit.WorkerGroup whose
every call is a method call on each actor. Each actor is a refit.EngineWorker:
it owns one checkpoint engine and a program (refit.testing.SyntheticSource / HashingDestination:
synthetic weights that change every refit, hashed on both sides).

--device cuda makes the policy's tensors torch CUDA tensors and the rollout receive torch tensors
(on the transfer device; with refit's default `device: cpu` transfer buffers that is host memory,
and a build without the CUDA data path stages each CUDA tensor through host memory). It needs
PyTorch with CUDA and a GPU per actor (or fractions: --gpus-per-actor); it is not run by the test
suite here (no GPU, and PyTorch's CUDA wheels are too large for these machines).

Exit status: 0 when every refit succeeded and every tensor matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import ray

import refit
from refit.ray import RayWorkerGroup
from refit.testing import HashingDestination, SyntheticSource, verify

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.normpath(os.path.join(HERE, "..", "..", "data", "models", "refit-tiny-moe"))


class PolicyWorker(refit.EngineWorker):
    """A policy rank: streams the model's weights (synthetic, new every refit)."""

    def __init__(self, rank: int, model: str, device: str):
        backend = "torch" if device != "cpu" else "numpy"
        super().__init__("policy", rank, SyntheticSource(model, backend=backend, device=device))


class RolloutWorker(refit.EngineWorker):
    """A rollout rank: hashes every tensor it receives (a real one would load_weights(batch))."""

    def __init__(self, rank: int, framework: str):
        super().__init__("rollout", rank, HashingDestination(), framework=framework)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="config.json directory or safetensors (default: refit-tiny-moe)")
    p.add_argument("--policy", type=int, default=2, help="policy actors (sources)")
    p.add_argument("--rollout", type=int, default=2, help="rollout actors (destinations)")
    p.add_argument("--refits", type=int, default=3)
    p.add_argument("--device", default="cpu", help="where the policy's tensors live: cpu (NumPy) or cuda[:N] (torch)")
    p.add_argument("--config", default=None, help="refit YAML (refit_cfg.nixl keys)")
    p.add_argument("--ratio", type=float, default=0.005,
                   help="update_weights_bucket_memory_ratio when --config does not set one (default 0.005)")
    p.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    p.add_argument("--actor-cpus", type=float, default=0, help="CPUs each actor reserves")
    p.add_argument("--gpus-per-actor", type=float, default=None, help="GPUs each actor reserves (cuda; default: share)")
    p.add_argument("overrides", nargs="*", help="refit config overrides, key=value (e.g. timeout_s=60)")
    args = p.parse_args(argv)

    overrides = list(args.overrides)
    if args.config is None:
        overrides.insert(0, f"update_weights_bucket_memory_ratio={args.ratio}")
    config = refit.as_config(args.config, overrides)
    framework = "torch" if args.device != "cpu" else "numpy"

    if args.address:
        ray.init(address=args.address)
    else:
        # address="local": always a fresh local instance, never one left over from an earlier run.
        ray.init(address="local", include_dashboard=False, num_cpus=max(2, os.cpu_count() or 2),
                 object_store_memory=256 << 20, logging_level="WARNING")
    try:
        gpus = 0.0
        if args.device != "cpu":
            gpus = args.gpus_per_actor if args.gpus_per_actor is not None else \
                min(1.0, ray.cluster_resources().get("GPU", 0) / (args.policy + args.rollout))
        options = {"num_cpus": args.actor_cpus, "num_gpus": gpus}
        policy_cls = ray.remote(PolicyWorker).options(**options)
        rollout_cls = ray.remote(RolloutWorker).options(**options)
        policy = [policy_cls.remote(rank, args.model, args.device) for rank in range(args.policy)]
        rollout = [rollout_cls.remote(rank, framework) for rank in range(args.rollout)]
        group = RayWorkerGroup(policy, rollout, timeout_s=config.timeout_s)

        inventory = refit.load_model_inventory(args.model)
        sync = refit.WeightSynchronizer(config, group, model_fingerprint=inventory.fingerprint)
        print(f"ray_refit: model {inventory.name} ({len(inventory)} tensors, {inventory.total_bytes / 2**30:.2f} GiB), "
              f"{args.policy} policy -> {args.rollout} rollout actors, {args.refits} refits, tensors on {args.device}",
              flush=True)
        ok = True
        for k in range(args.refits):
            report = sync.sync_weights()
            problems = verify(report.results, group.train_world_size)
            received = sum(r["stats"]["payload_bytes"] for r in report.destination_results)
            ok = ok and not problems
            print(f"refit {k}: {report.seconds:.3f} s, {received / 2**30:.3f} GiB received, "
                  f"{received / report.seconds / 2**30:.2f} GiB/s, bucket {sync.bucket_size.bytes >> 20} MiB, "
                  f"verified: {'yes' if not problems else 'NO'}", flush=True)
            for problem in problems[:20]:
                print(f"  {problem}", flush=True)
        sync.shutdown()
        print(f"ray_refit: {'all refits verified' if ok else 'VERIFICATION FAILED'}", flush=True)
        return 0 if ok else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
