#!/usr/bin/env python3
"""What refit costs per tensor from Python: a source and a destination engine in this process (the
source on a thread; both release the GIL while they transfer) refit N small tensors over UCX,
first as most code calls it (send_weights over (name, array) pairs, receive_weights with a Python
callback that copies each array into its parameter), then with refit.TensorSet and
refit.ParameterLoader (both sides in C++, no Python per tensor). Every refit is checked.

    python python/bench/bench_tensors.py                 # 50,000 tensors of 1 KiB, 16 MiB buckets
    python python/bench/bench_tensors.py --tensors 10000 --refits 9
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

import refit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=50000)
    parser.add_argument("--bytes", type=int, default=1024, help="per tensor")
    parser.add_argument("--bucket", default="16MiB")
    parser.add_argument("--refits", type=int, default=7)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    source = {f"model.layers.{i // 100}.t{i % 100}.weight": rng.integers(0, 255, args.bytes, dtype=np.uint8)
              for i in range(args.tensors)}
    params = {name: np.zeros_like(t) for name, t in source.items()}
    cfg = refit.as_config({"bucket_bytes": args.bucket, "timeout_s": 120})
    session = refit.new_session_id()
    bucket = int(cfg.bucket_bytes)
    src = refit.CheckpointEngine(bucket, cfg, session=session)
    dst = refit.CheckpointEngine(bucket, cfg, session=session, framework="numpy", receives_only=True)
    md = [src.prepare(), dst.prepare()]
    src.init_policy_process_group(0, 1, 1, md)
    dst.init_rollout_process_group(0, 1, 1, md)

    def python_loader(batch):
        for name, t in batch:
            params[name][...] = t

    tensor_set, parameter_loader = refit.TensorSet(source), refit.ParameterLoader(params)
    ways = {
        "pairs + Python callback": (lambda: list(source.items()), lambda: python_loader),
        "TensorSet + ParameterLoader": (lambda: tensor_set, lambda: parameter_loader),
    }
    print(f"{args.tensors} tensors of {args.bytes} B, {args.bucket} buckets, {args.refits} refits each (UCX, one "
          "process, the source on a thread)")
    for label, (weights, load) in ways.items():
        seconds = []
        for r in range(args.refits):
            for t in source.values():
                t[0] = r  # new content every refit
            result = {}
            sender = threading.Thread(target=lambda: result.update(stats=src.send_weights(weights())))
            start = time.perf_counter()
            sender.start()
            dst.receive_weights(load())
            sender.join()
            seconds.append(time.perf_counter() - start)
            bad = [n for n, t in source.items() if not np.array_equal(params[n], t)]
            if bad:
                raise SystemExit(f"{label}: refit {r}: {len(bad)} tensors differ, e.g. {bad[0]}")
        median = statistics.median(seconds[1:] if len(seconds) > 1 else seconds)
        print(f"{label:28s} median {median:.4f} s per refit = {median / args.tensors * 1e6:.2f} us per tensor "
              f"(refits: {' '.join(f'{s:.3f}' for s in seconds)})")
    dst.close()
    src.close()


if __name__ == "__main__":
    main()
