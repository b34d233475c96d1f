#!/usr/bin/env python3
"""Checks the cluster planner against runs on this machine: for each setup it runs `refit bench`
(local processes, or simulated hosts with shaped links) and `refit plan --cluster` for the same
setup, and prints predicted, measured (median refit time) and their ratio. A benchmark, not a
test: it prints the table and never fails on a ratio.

Each local setup runs on the default path (destinations on their source's host read in place,
refit_cfg.nixl.direct_reads=true) and on the bucket path (direct_reads=false), one row each;
--path picks one. Simulated hosts are remote to each other: nothing maps there (destinations read the
sources' large tensors from their memory instead, spans); they run the default path only. The "in place" column: the share of the bytes read in place,
predicted / measured.

Each setup is measured in --runs runs of --refits refits (default 3 of 9): the measured time is the
median of every refit but each run's first, and the table shows the run medians' spread too, since
on a small shared host one run of the same setup differs from the next by 10-20%.

Usage: scripts/check_planner.py [--calibration FILE] [--refits N] [--runs N] [--hosts RATE ...] [--only NAME ...]
                                [--path default|buckets|both]
  --calibration: the machine's calibration (default build/calibration.json; made by
                 scripts/calibrate.sh when missing)
  --hosts RATE:  also the simulated-hosts setups at this link rate (e.g. 1gbit; needs root)
  --gpu:         the GPU setups instead (one GPU, and two when present; run on the GPU machine)
  --path:        default (reads in place), buckets, or both (the default)
Environment: BUILD_DIR (default build/release).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD_DIR", "build/release")
REFIT = os.path.join(ROOT, BUILD, "refit")
SMALL = {"model_type": "qwen3_moe", "torch_dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 512,
         "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 16000, "num_experts": 16, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

# name, model, sources, destinations, source parallel, destination parallel, bucket
CPU_SETUPS = [
    ("tiny 1->1 whole bucket", "builtin:refit-tiny-moe", 1, 1, {}, {}, "1GiB"),
    ("tiny 1->1 64MiB", "builtin:refit-tiny-moe", 1, 1, {}, {}, "64MiB"),
    ("tiny 1->1 16MiB", "builtin:refit-tiny-moe", 1, 1, {}, {}, "16MiB"),
    ("small 1->1 4MiB", "small", 1, 1, {}, {}, "4MiB"),
    ("2g 1->1 256MiB", "data/models/refit-bench-2g", 1, 1, {}, {}, "256MiB"),
    ("tiny 2->2 64MiB", "builtin:refit-tiny-moe", 2, 2, {}, {}, "64MiB"),
    ("tiny reshard TP2->TP2 16MiB", "builtin:refit-tiny-moe", 2, 2, {"tp": 2}, {"tp": 2, "shard_dense": True}, "16MiB"),
    ("tiny reshard TP2xDP2->TP2 64MiB", "builtin:refit-tiny-moe", 4, 2, {"tp": 2, "dp": 2},
     {"tp": 2, "shard_dense": True}, "64MiB"),
]
HOST_SETUPS = [
    ("hosts small 2->2 4MiB", "small", 2, 2, {}, {}, "4MiB"),
    ("hosts tiny 2->2 64MiB", "builtin:refit-tiny-moe", 2, 2, {}, {}, "64MiB"),
    ("hosts tiny reshard 4->2 16MiB", "builtin:refit-tiny-moe", 4, 2, {"tp": 2, "dp": 2},
     {"tp": 2, "shard_dense": True}, "16MiB"),
]


def bench_flags(src, dst):
    flags = []
    for key, value in src.items():
        flags += [f"--src-{key}", str(value)]
    for key, value in dst.items():
        if key == "shard_dense":
            flags += ["--shard-dense"] if value else []
        else:
            flags += [f"--{key}", str(value)]
    return flags


def yaml_parallel(p):
    return "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in p.items()) + "}"


def cluster_yaml(name, sources, destinations, src, dst, bucket, hosts_rate=None, gpu=None, direct_reads=True):
    if hosts_rate:
        # One process per simulated host: each host's link is shaped to the rate, both ways.
        bits = rate_bits(hosts_rate)
        # ... all of them namespaces of this one machine, talking TCP.
        nodes = (f"  - {{name: hosts, count: {sources + destinations}, workers: 1, device: cpu, machine: this, "
                 f"nic: {{per: node, rate: {bits / 1e9}Gbit}}}}\n")
        side = "hosts"
    elif gpu:
        nodes = f"  - {{name: gpu, count: 1, workers: {sources + destinations}, gpus: {gpu[0]}, device: gpu}}\n"
        side = "gpu"
    else:
        nodes = "  - {name: host, count: 1, workers: 64, device: cpu}\n"
        side = "host"
    return (f"name: {name}\nnodes:\n{nodes}"
            f"sources: {{nodes: {side}, ranks: {sources}, parallel: {yaml_parallel(src)}}}\n"
            f"destinations: {{nodes: {side}, ranks: {destinations}, parallel: {yaml_parallel(dst)}}}\n"
            f"transfer: {{transport: {gpu[1] if gpu else 'ucx'}, bucket: {bucket}"
            f"{', buffers: host' if gpu and gpu[2] == 'host' else ''}{', tcp: true' if hosts_rate else ''}"
            f", direct_reads: {str(direct_reads).lower()}}}\n")


def rate_bits(rate):
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def refit_seconds(result):
    """Every refit that succeeded but the first (which also faults buffers in)."""
    ok = [r["seconds"] for r in result["refits"] if r.get("ok")]
    if not result.get("verified"):
        raise SystemExit("check_planner: a refit did not verify")
    return ok[1:] if len(ok) > 2 else ok


def in_place_share(result):
    """The share of the bytes the destinations read in place, over the refits that succeeded."""
    received = [d for r in result["refits"] if r.get("ok") for d in r.get("bytes_received", [])]
    total = sum(d["bytes"] for d in received)
    return sum(d.get("in_place_bytes", 0) for d in received) / total if total else 0.0


def run_bench(model, sources, destinations, flags, bucket, refits, work, hosts_rate=None, extra=(), env=None,
              direct_reads=True):
    out = os.path.join(work, "bench.json")
    args = ["--model", model, "--sources", str(sources), "--destinations", str(destinations), "--refits", str(refits),
            *flags, *extra, f"refit_cfg.nixl.bucket_bytes={bucket}",
            f"refit_cfg.nixl.direct_reads={str(direct_reads).lower()}"]
    if hosts_rate:
        # hosts_bench.sh names its models: small (the same config as SMALL here) and builtin.
        name = "small" if model.endswith("small.json") else "builtin" if model.startswith("builtin:") else model
        env = dict(os.environ, BUILD_DIR=BUILD, SOURCES=str(sources), DESTINATIONS=str(destinations),
                   BENCH_ARGS=" ".join(flags), MODELS=name, BUCKETS=bucket, KEEP_JSON=out)
        subprocess.run([os.path.join(ROOT, "scripts/hosts_bench.sh"), hosts_rate, str(refits)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    else:
        subprocess.run([REFIT, "bench", *args, "--json", out], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, env=env)
    return json.load(open(out))


def predict(yaml_text, model, calibration, work):
    path = os.path.join(work, "cluster.yaml")
    open(path, "w").write(yaml_text)
    out = os.path.join(work, "plan.json")
    cmd = [REFIT, "plan", "--cluster", path, "--model", model, "--json", out]
    if calibration:
        cmd += ["--calibration", calibration]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    refit = json.load(open(out))["prediction"]["refit"]
    received = sum(w["bytes"] for w in refit["workers"] if w["worker"].startswith("destination"))
    return refit["seconds"], refit.get("in_place_bytes", 0) / received if received else 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calibration", default=os.path.join(ROOT, BUILD, "calibration.json"))
    parser.add_argument("--refits", type=int, default=9)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hosts", action="append", default=[])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--path", choices=["default", "buckets", "both"], default="both")
    args = parser.parse_args()
    if not os.path.exists(args.calibration):
        subprocess.run([os.path.join(ROOT, "scripts/calibrate.sh"), args.calibration], check=True)
    work = tempfile.mkdtemp(prefix="check-planner-")
    small = os.path.join(work, "small.json")
    json.dump(SMALL, open(small, "w"))
    runs = []
    paths = {"default": [True], "buckets": [False], "both": [True, False]}[args.path]
    if args.gpu:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
        runs += [(s[:7], None, s[7:], reads) for s in GPU_SETUPS if s[7] <= gpus for reads in paths]
    else:
        runs += [(s, None, None, reads) for s in CPU_SETUPS for reads in paths]
        for rate in args.hosts:  # remote: nothing maps; the default path reads spans
            runs += [(s, rate, None, True) for s in HOST_SETUPS]
    print(f"{'setup':<58} {'predicted s':>12} {'measured s':>11} {'ratio':>7} {'in place':>11} {'runs':>17}")
    ratios = {True: [], False: []}
    for (name, model, sources, destinations, src, dst, bucket), rate, gpu, reads in runs:
        label = name + (f" @{rate}" if rate else "") + (f" {gpu[1]}{' host buffers' if gpu[2] == 'host' else ''} "
                                                         f"on {gpu[0]} GPU(s)" if gpu else "")
        label += "" if rate else (" [default]" if reads else " [buckets]")
        if args.only and not any(o in label for o in args.only):
            continue
        model_path = small if model == "small" else model
        extra, env = (), None
        if gpu:
            gpu_count, transport, buffers = gpu
            # --device cuda: the local group spreads its workers over the visible GPUs; --device
            # cpu with GPU tensors: pinned host buffers.
            extra = ("--device", "cuda" if buffers == "device" else "cpu", "--tensors", "cuda",
                     f"refit_cfg.nixl.backend_name={transport.upper()}")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(g) for g in range(gpu_count)))
        seconds, run_medians = [], []
        for _ in range(args.runs):
            result = run_bench(model_path, sources, destinations, bench_flags(src, dst), bucket, args.refits, work,
                               rate, extra, env, reads)
            run = refit_seconds(result)
            seconds += run
            run_medians.append(statistics.median(run))
        measured, measured_share = statistics.median(seconds), in_place_share(result)
        name_in_yaml = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)
        predicted, predicted_share = predict(
            cluster_yaml(name_in_yaml, sources, destinations, src, dst, bucket, rate, gpu, reads), model_path,
            args.calibration, work)
        ratios[reads].append(predicted / measured)
        share = f"{predicted_share:.2f}/{measured_share:.2f}"
        spread = f"{min(run_medians):.4f}-{max(run_medians):.4f}"
        print(f"{label:<58} {predicted:12.4f} {measured:11.4f} {predicted / measured:7.3f} {share:>11} {spread:>17}",
              flush=True)
    for reads, path in ((True, "default path"), (False, "bucket path")):
        if ratios[reads]:
            inside = sum(1 for r in ratios[reads] if 0.85 <= r <= 1.15)
            print(f"{path}: {inside} of {len(ratios[reads])} within +-15%")
    print(f"measured: median of {args.runs} runs x {args.refits} refits (each run's first left out); runs: the "
          f"spread of the run medians; calibration {args.calibration}")


# ... and the GPUs they need, the transport, and where the transfer buffers are.
GPU_SETUPS = [
    ("qwen3-8b 1->1 1GiB", "data/models/qwen3-8b", 1, 1, {}, {}, "1GiB", 1, "cuda_ipc", "device"),
    ("qwen3-8b 1->1 256MiB", "data/models/qwen3-8b", 1, 1, {}, {}, "256MiB", 1, "cuda_ipc", "device"),
    ("qwen3-8b 1->1 2GiB", "data/models/qwen3-8b", 1, 1, {}, {}, "2GiB", 1, "ucx", "host"),
    ("qwen3-8b 1->1 1GiB", "data/models/qwen3-8b", 1, 1, {}, {}, "1GiB", 2, "cuda_ipc", "device"),
    ("qwen3-8b 1->1 256MiB", "data/models/qwen3-8b", 1, 1, {}, {}, "256MiB", 2, "cuda_ipc", "device"),
    ("qwen3-8b 1->1 1GiB", "data/models/qwen3-8b", 1, 1, {}, {}, "1GiB", 2, "nccl", "device"),
    ("qwen3-8b 2->2 1GiB", "data/models/qwen3-8b", 2, 2, {}, {}, "1GiB", 2, "cuda_ipc", "device"),
]

if __name__ == "__main__":
    main()
