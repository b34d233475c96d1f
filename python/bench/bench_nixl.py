#!/usr/bin/env python3
"""refit over NIXL beside refit over UCX, with NIXL's own READ as the ceiling, in one run.

Every row moves the same model between two local processes (one source, one destination) with
the same bucket size, and the destination's parameters are checked bitwise after the last refit
(XXH3-64 per tensor against the source's):

  - refit UCX:          backend_name UCX, the default (a destination on the source's host loads
                        from the source's buffers mapped through shared memory);
  - refit UCX reads:    backend_name UCX with map_source_buffers=false (one-sided reads, as NIXL);
  - refit NIXL:         backend_name NIXL (refit.nixl: the same engine, NIXL's UCX plugin);
  - refit NIXL source reads: the same with backend_init_params.read_source_memory=true (with
                        --in-place the destination READs the source's large tensors where they lie);
  - NIXL READ ceiling:  two NIXL agents in two processes, one READ of one bucket-sized buffer,
                        repeated (no engine, no pack or load).

The source's tensors are made once (their first bytes change every refit); the destination copies
every tensor into its own parameters, as a loader does, and hashes them after the last refit, so
the timed part is the refit alone. Throughput is payload bytes / the destination's wall time of a
refit (median over the refits after the first), then the median over rounds (rows alternate their
order). With ``--device cuda`` the tensors, parameters and transfer buffers are GPU memory (torch),
the ceiling READs GPU memory, and the rows are refit over CUDA IPC (refit's GPU path on one host)
and refit over NIXL.

    python python/bench/bench_nixl.py                          # refit-bench-2g, 256 MiB buckets
    python python/bench/bench_nixl.py --device cuda --json nixl.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import List, Optional

import numpy as np

import refit

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
GiB = float(1 << 30)

ROWS = {
    "cpu": {
        "refit UCX": ["backend_name=UCX"],
        "refit UCX reads": ["backend_name=UCX", "map_source_buffers=false"],
        "refit NIXL": ["backend_name=NIXL"],
        # With --in-place: the destination READs the source's large tensors where they lie.
        "refit NIXL source reads": ["backend_name=NIXL", "backend_init_params.read_source_memory=true"],
    },
    # refit's GPU path on one host is CUDA IPC (the UCX that refit builds against may lack CUDA).
    "cuda": {
        "refit CUDA_IPC": ["backend_name=CUDA_IPC"],
        "refit NIXL": ["backend_name=NIXL"],
        "refit NIXL source reads": ["backend_name=NIXL", "backend_init_params.read_source_memory=true"],
    },
}


def _model_tensors(model: str):
    return [(t.name, t.nbytes) for t in refit.load_model_inventory(model).tensors]


def _make(nbytes: int, device: str, fill: Optional[int] = None):
    if device == "cpu":
        return np.zeros(nbytes, np.uint8) if fill is None else np.full(nbytes, fill, np.uint8)
    import torch
    if fill is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return torch.full((nbytes,), fill, dtype=torch.uint8, device=device)


def _hash(tensor) -> int:
    return refit.xxh3_64(tensor if isinstance(tensor, np.ndarray) else tensor.cpu().numpy())


def _stamp(weights, refit_index: int, device: str) -> None:
    """Makes every refit's bytes differ from the last one's (the first 8 bytes of each tensor)."""
    for i, (_, tensor) in enumerate(weights):
        n = min(8, tensor.shape[0])
        value = (refit_index * 131 + i) % 251
        tensor[:n] = value


def _destination(conn, model: str, bucket: int, config_yaml: str, refits: int, device: str, session: bytes) -> None:
    """Receives `refits` refits into its own parameters (a loader's copy, as a real destination),
    timing each from the start of the receive to the last load; hashes the parameters afterwards."""
    try:
        refit.set_log_level("warning")
        framework = "numpy" if device == "cpu" else "torch"
        engine = refit.create_checkpoint_engine("nixl", bucket, {"nixl": refit.parse_config(config_yaml),
                                                                 "session": session, "framework": framework})
        params = {name: _make(nbytes, device) for name, nbytes in _model_tensors(model)}
        conn.send(engine.prepare())
        engine.init_rollout_process_group(0, 1, 1, conn.recv())

        def load(batch):
            for name, tensor in batch:
                target = params[name]
                if framework == "numpy":
                    np.copyto(target, tensor.reshape(-1).view(np.uint8))
                else:
                    target.copy_(tensor.reshape(-1).view(torch.uint8))
            if framework == "torch":
                torch.cuda.synchronize()

        if framework == "torch":
            import torch
        seconds, loads = [], []
        for _ in range(refits):
            conn.send("ready")
            start = time.perf_counter()
            stats = engine.receive_weights(load)
            seconds.append(time.perf_counter() - start)
            loads.append(stats["load_seconds"])
        conn.send(("done", seconds, loads, stats["payload_bytes"], {n: _hash(t) for n, t in params.items()}))
        engine.finalize()
        engine.close()
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", repr(e)))


def run_refit(model: str, refits: int, bucket: str, overrides: List[str], device: str, in_place: bool = False) -> dict:
    """One source (this process) and one destination (a spawned process); the source's tensors are
    made once and stamped anew every refit; the destination copies into its own parameters."""
    config = refit.as_config({"bucket_bytes": bucket, "device": device}, overrides)
    bucket_bytes = config.bucket_bytes
    session = refit.new_session_id()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_destination, args=(child, model, bucket_bytes, config.to_yaml(), refits, device,
                                                  session), daemon=True)
    proc.start()
    try:
        engine = refit.create_checkpoint_engine("nixl", bucket_bytes, {"nixl": config, "session": session})
        weights = [(name, _make(nbytes, device, 1)) for name, nbytes in _model_tensors(model)]
        first = parent.recv()
        if isinstance(first, tuple):
            raise RuntimeError(f"destination: {first[1]}")
        metadata = [engine.prepare(), first]
        parent.send(metadata)
        engine.init_policy_process_group(0, 1, 1, metadata)
        sends = []
        for k in range(refits):
            _stamp(weights, k, device)
            if device != "cpu":
                import torch
                torch.cuda.synchronize()
            ready = parent.recv()
            if ready != "ready":
                raise RuntimeError(f"destination: {ready[1]}")
            sends.append(engine.send_weights(weights, in_place=in_place)["seconds"])
        reply = parent.recv()
        if reply[0] != "done":
            raise RuntimeError(f"destination: {reply[1]}")
        _, seconds, loads, payload, hashes = reply
        verified = hashes == {name: _hash(t) for name, t in weights}
        engine.finalize()
        engine.close()
        proc.join(60)
        rates = [payload / s for s in seconds]
        # Where a refit's time goes: the source's send() (pulling and packing its tensors) and the
        # destination's loader calls, beside the refit's wall time.
        return {"median": statistics.median(rates[1:] or rates), "rates": rates, "verified": verified,
                "seconds": seconds, "send_seconds": sends, "load_seconds": loads}
    finally:
        if proc.is_alive():
            proc.kill()


def _buffer(nbytes: int, device: str, fill: int):
    if device == "cpu":
        array = np.full(nbytes, fill, np.uint8)
        return array, array.ctypes.data, -1
    import torch
    tensor = torch.full((nbytes,), fill, dtype=torch.uint8, device=device)
    return tensor, tensor.data_ptr(), tensor.device.index or 0


def _nixl_config(device: str, params: dict):
    return refit.as_config({"backend_name": "NIXL", "device": device, "backend_init_params": params or None})


def _ceiling_target(conn, nbytes: int, device: str, params: dict) -> None:
    """The ceiling's source: registers a bucket-sized buffer and keeps NIXL progressing (it must,
    for reads of it to complete) until told to stop."""
    from refit.nixl import NixlTransport
    transport = NixlTransport(_nixl_config(device, params))
    buffer, address, dev = _buffer(nbytes, device, 7)
    region = transport.register(address, nbytes, dev)
    conn.send((transport.address(), address, transport.describe(region)))
    peer = transport.connect(conn.recv(), "the reader")
    while not conn.poll(0):
        transport.poll(peer)
    conn.recv()
    del buffer


def run_ceiling(nbytes: int, reads: int, device: str, params: Optional[dict] = None) -> dict:
    """NIXL's own READ of one bucket-sized buffer from another process (refit.nixl's agent setup:
    the UCX plugin, no progress thread), `reads` times."""
    from refit.nixl import NixlTransport
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ceiling_target, args=(child, nbytes, device, params), daemon=True)
    proc.start()
    try:
        transport = NixlTransport(_nixl_config(device, params))
        address, remote, key = parent.recv()
        peer = transport.connect(address, "the target")
        parent.send(transport.address())
        buffer, local, dev = _buffer(nbytes, device, 0)
        region = transport.register(local, nbytes, dev)
        rates = []
        for _ in range(reads + 1):
            start = time.perf_counter()
            read = transport.post_read(peer, key, remote, local, region, nbytes)
            deadline = start + 60
            while not transport.test_read(read):
                if time.perf_counter() > deadline:
                    transport.cancel_read(read)
                    raise RuntimeError(f"NIXL READ of {nbytes} bytes did not complete in 60 s")
            rates.append(nbytes / (time.perf_counter() - start))
        if device == "cpu":
            verified = bool((buffer == 7).all())
        else:
            verified = bool((buffer == 7).all().item())
        transport.deregister(region)
        parent.send("stop")
        proc.join(30)
        rates = rates[1:]  # the first read also connects
        return {"median": statistics.median(rates), "rates": rates, "verified": verified}
    finally:
        if proc.is_alive():
            proc.kill()


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def device_copy_rate(nbytes: int, device: str, repeats: int = 10) -> float:
    """A bucket-sized copy within one process (memcpy, or a device-to-device copy): for context."""
    source, target = _make(nbytes, device, 3), _make(nbytes, device)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        if device == "cpu":
            np.copyto(target, source)
        else:
            import torch
            target.copy_(source)
            torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates[1:])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(REPO, "data", "models", "refit-bench-2g"))
    p.add_argument("--refits", type=int, default=5, help="refits per row and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket", default="256MiB", help="bucket_bytes of every row and the ceiling's buffer size")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (torch tensors and GPU transfer buffers)")
    p.add_argument("--rows", default=None, help="which refit rows to run, comma-separated (default: all of the device's)")
    p.add_argument("--in-place", action="store_true",
                   help="sources send with in_place=True (destinations that map them load from their tensors)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)

    bucket_bytes = refit.as_config({"bucket_bytes": args.bucket}).bucket_bytes
    table = ROWS["cpu" if args.device == "cpu" else "cuda"]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else list(table)
    unknown = [r for r in rows if r not in table]
    if unknown:
        p.error(f"unknown rows {unknown} for device {args.device}; expected some of {list(table)}")
    inventory = refit.load_model_inventory(args.model)
    print(f"bench_nixl: model {inventory.name} ({len(inventory)} tensors, {inventory.total_bytes / GiB:.2f} GiB), "
          f"1 source -> 1 destination, bucket {args.bucket}, device {args.device}, {args.refits} refits x "
          f"{args.rounds} rounds{', sources in place' if args.in_place else ''}", flush=True)
    refit.set_log_level("warning")
    results = {row: [] for row in rows + ["NIXL READ ceiling"]}
    ok = True
    for r in range(args.rounds):
        order = rows + ["NIXL READ ceiling"]
        if r % 2:
            order.reverse()
        for row in order:
            if row == "NIXL READ ceiling":
                result = run_ceiling(bucket_bytes, max(args.refits, 5), args.device)
            else:
                result = run_refit(args.model, args.refits, args.bucket, table[row], args.device, args.in_place)
            ok = ok and result["verified"]
            results[row].append(result)
            print(f"round {r}: {row:18} {result['median'] / GiB:7.2f} GiB/s "
                  f"[{', '.join(f'{x / GiB:.2f}' for x in result['rates'])}] "
                  f"verified: {'yes' if result['verified'] else 'NO'}", flush=True)
            if "seconds" in result:
                print(f"    refit s {_fmt(result['seconds'])}  source send() s {_fmt(result['send_seconds'])}  "
                      f"destination loader s {_fmt(result['load_seconds'])}", flush=True)
    ceiling = statistics.median(x["median"] for x in results["NIXL READ ceiling"])
    copy = device_copy_rate(bucket_bytes, args.device)
    summary = {}
    print(f"median over {args.rounds} rounds ({args.device}, bucket {args.bucket}):")
    for row, runs in results.items():
        median = statistics.median(x["median"] for x in runs)
        summary[row] = {"bytes_per_s": median, "ratio_to_nixl_read": median / ceiling}
        print(f"  {row:18} {median / GiB:7.2f} GiB/s = {median / ceiling:.2f} of NIXL's READ", flush=True)
    print(f"  (a bucket-sized copy within this process: {copy / GiB:.2f} GiB/s; NIXL's READ is "
          f"{ceiling / copy:.2f} of it)")
    print(f"verified: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": inventory.name, "bucket": args.bucket, "device": args.device, "refits": args.refits,
                       "rounds": args.rounds, "runs": results, "summary": summary,
                       "local_copy_bytes_per_s": copy, "verified": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
