#!/usr/bin/env python3
"""What the Python layer costs: the same refits driven from Python and by `refit bench`, in one run.

Both sides run the same model, transport (UCX, local processes), bucket size and topology, and
both check every tensor of every refit (XXH3-64 per tensor on each side). Both send every tensor
through the buckets (refit_cfg.nixl.direct_reads=false, unless an override says otherwise): the
Python source's NumPy arrays are not in engine memory, which a destination needs to load tensors
in place, while `refit bench`'s sources place theirs there (CheckpointEngine::allocate_weight_memory).

  - C++:    `refit bench --model M --sources 1 --destinations 1 --refits K bucket_bytes=B`
  - Python: refit.WeightSynchronizer over refit.multiprocessing_group.ProcessWorkerGroup (spawned
            processes); the source streams NumPy arrays through send_weights(); the destination, as
            refit bench's, copies every tensor into NumPy parameters of its own (a TensorProgram:
            refit.ParameterLoader) and hashes them after the timed refit (--destination load, the
            default), or hashes every tensor from Python as it arrives (--destination hash), in a
            receive_weights(load) callback (default) or iterating receive_weight_batches()
            (--receive iterator, hashing destinations only).

Each round runs both (alternating which goes first), each side's throughput is the median over
its refits of the destination's bytes over its refit's time as its engine measured it (begin to
end of the receive: the source's stream and the destination's loads, not the programs' reports
nor the driver's calls around them), and the result is the median over rounds. The Python
layer's cost is 1 - python/cpp. The driver's wall time of each refit is printed beside it.

    python python/bench/bench_python.py                        # refit-bench-2g, 256 MiB, 1 -> 1
    python python/bench/bench_python.py --rounds 5 --refits 5 --json out.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import refit
from refit.multiprocessing_group import ProcessWorkerGroup
from refit.testing import SyntheticPrograms, verify

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
GiB = float(1 << 30)


def find_refit_binary(explicit: Optional[str]) -> str:
    """--refit, else the CLI of the Python build tree (same compiler flags), build/release, PATH."""
    candidates = [explicit] if explicit else []
    candidates += sorted(glob.glob(os.path.join(REPO, "build", "py", "*", "refit")))
    candidates += [os.path.join(REPO, "build", "release", "refit"), shutil.which("refit") or ""]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("no `refit` binary found: build it (cmake --build build/py/<tag> --target refit_cli, or "
                     "scripts/setup.sh) or pass --refit PATH")


def run_cpp(binary: str, model: str, refits: int, bucket: str, overrides: List[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [binary, "bench", "--model", model, "--sources", "1", "--destinations", "1", "--refits", str(refits),
               "--json", out, f"bucket_bytes={bucket}"] + overrides
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
    dest = [r["bytes_received"][0] for r in data["refits"]]
    rates = [d["bytes"] / (d["receive_seconds"] + d["load_seconds"]) for d in dest]
    return {"median": statistics.median(rates), "rates": rates, "verified": data["verified"],
            "seconds": [r["seconds"] for r in data["refits"]], "command": " ".join(cmd),
            "load_seconds": [d["load_seconds"] for d in dest], "receive_seconds": [d["receive_seconds"] for d in dest]}


def run_python(model: str, refits: int, bucket: str, overrides: List[str], framework: str,
               receive: str, destination: str) -> dict:
    config = refit.as_config({"bucket_bytes": bucket}, overrides)
    programs = SyntheticPrograms(model, destination=destination)
    rates, seconds, verified, load, receive_s, send = [], [], True, [], [], []
    with ProcessWorkerGroup(1, 1, programs, framework=framework, receive=receive,
                            log_level="warning") as group:
        sync = refit.WeightSynchronizer(config, group, model_fingerprint=refit.load_model_inventory(model).fingerprint)
        for _ in range(refits):
            report = sync.sync_weights()
            problems = verify(report.results, 1)
            verified = verified and not problems
            stats = report.destination_results[0]["stats"]
            rates.append(stats["payload_bytes"] / (stats["receive_seconds"] + stats["load_seconds"]))
            seconds.append(report.seconds)
            load.append(stats["load_seconds"])
            receive_s.append(stats["receive_seconds"])
            send.append(report.source_results[0]["stats"]["seconds"])
        sync.shutdown()
    return {"median": statistics.median(rates), "rates": rates, "verified": verified, "seconds": seconds,
            "load_seconds": load, "receive_seconds": receive_s, "send_seconds": send}


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "data", "models", "refit-bench-2g"))
    p.add_argument("--refits", type=int, default=5, help="refits per run (each side)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--bucket", default="256MiB", help="bucket_bytes of both sides")
    p.add_argument("--refit", default=None, help="the refit binary (default: found in build/)")
    p.add_argument("--framework", default="numpy", help="how the Python destination receives tensors")
    p.add_argument("--receive", default="callback", choices=["callback", "iterator"],
                   help="how the Python destination drives a refit: receive_weights(load) (default) or "
                        "iterating receive_weight_batches()")
    p.add_argument("--destination", default="load", choices=["load", "hash"],
                   help="what the Python destination does: copy into parameters of its own, hashed after the "
                        "refit, as refit bench's (default), or hash every tensor as it arrives")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("overrides", nargs="*", help="refit config overrides for both sides, key=value")
    args = p.parse_args(argv)
    if args.receive == "iterator" and args.destination == "load":
        p.error("--receive iterator needs --destination hash (a TensorProgram receives by callback)")
    # The same data path on both sides (see above).
    if not any(o.split("=", 1)[0].endswith("direct_reads") for o in args.overrides):
        args.overrides.append("direct_reads=false")

    binary = find_refit_binary(args.refit)
    inventory = refit.load_model_inventory(args.model)
    print(f"bench_python: model {inventory.name} ({len(inventory)} tensors, {inventory.total_bytes / GiB:.2f} GiB), "
          f"1 source -> 1 destination, bucket {args.bucket}, {args.refits} refits x {args.rounds} rounds per side, "
          f"Python receives {args.framework} with {args.receive} ({args.destination}); "
          f"C++: {binary}", flush=True)
    refit.set_log_level("warning")
    cpp_medians, py_medians, rounds = [], [], []
    ok = True
    for r in range(args.rounds):
        order = ("cpp", "python") if r % 2 == 0 else ("python", "cpp")
        result = {}
        for side in order:
            start = time.monotonic()
            if side == "cpp":
                result[side] = run_cpp(binary, args.model, args.refits, args.bucket, args.overrides)
            else:
                result[side] = run_python(args.model, args.refits, args.bucket, args.overrides, args.framework,
                                          args.receive, args.destination)
            result[side]["wall"] = time.monotonic() - start
        ok = ok and result["cpp"]["verified"] and result["python"]["verified"]
        cpp_medians.append(result["cpp"]["median"])
        py_medians.append(result["python"]["median"])
        rounds.append(result)
        print(f"round {r}: C++ {result['cpp']['median'] / GiB:.2f} GiB/s "
              f"[{', '.join(f'{x / GiB:.2f}' for x in result['cpp']['rates'])}], "
              f"Python {result['python']['median'] / GiB:.2f} GiB/s "
              f"[{', '.join(f'{x / GiB:.2f}' for x in result['python']['rates'])}], "
              f"ratio {result['python']['median'] / result['cpp']['median']:.3f}, "
              f"verified: {'yes' if result['cpp']['verified'] and result['python']['verified'] else 'NO'}", flush=True)
        for side in ("cpp", "python"):
            x = result[side]
            print(f"  {side:6} seconds {_fmt(x['seconds'])}  destination load {_fmt(x['load_seconds'])}  "
                  f"receive {_fmt(x['receive_seconds'])}"
                  + (f"  source send {_fmt(x['send_seconds'])}" if "send_seconds" in x else ""), flush=True)
    cpp, py = statistics.median(cpp_medians), statistics.median(py_medians)
    ratios = [p_ / c_ for p_, c_ in zip(py_medians, cpp_medians)]
    ratio = py / cpp
    print(f"median: C++ {cpp / GiB:.2f} GiB/s, Python {py / GiB:.2f} GiB/s, ratio {ratio:.3f} "
          f"(per-round ratios {', '.join(f'{x:.3f}' for x in ratios)}); Python layer cost {100 * (1 - ratio):.1f}% "
          f"(target <= 5%); verified: {'yes' if ok else 'NO'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": inventory.name, "bucket": args.bucket, "refits": args.refits, "rounds": rounds,
                       "cpp_median_bytes_per_s": cpp, "python_median_bytes_per_s": py, "ratio": ratio,
                       "framework": args.framework, "receive": args.receive,
                       "verified": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
