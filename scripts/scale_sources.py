#!/usr/bin/env python3
"""How a refit's cost grows with the number of sources one destination reads from: for each N it
runs `refit bench --sources N --destinations 1 --src-fsdp N` (N local processes, each holding its
FSDP shard of every tensor, over UCX shared memory) and reports the median refit time, the
fixed cost per source and the destination's threads. A benchmark, not a test: it never fails on a
figure.

Usage: scripts/scale_sources.py [--sources 1 8 64 256] [--model M] [--refits K] [--runs R]
                                [--json OUT.json] [--plot OUT.png] [overrides...]
       scripts/scale_sources.py --replot OUT.json --plot OUT.png
Environment: BUILD_DIR (default build/release).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFIT = os.path.join(ROOT, os.environ.get("BUILD_DIR", "build/release"), "refit")


def refit_seconds(report):
    """Every refit's seconds but the first (it connects and registers)."""
    times = [r["seconds"] for r in report["refits"]]
    return times[1:] if len(times) > 1 else times


def run(n, args):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [REFIT, "bench", "--model", args.model, "--sources", str(n), "--destinations", "1", "--refits",
               str(args.refits), "--json", out.name]
        if n > 1:
            cmd += ["--src-fsdp", str(n)]
        cmd += args.overrides
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        report = json.load(open(out.name))
    if not report["verified"]:
        sys.exit(f"{' '.join(cmd)}: a destination's bytes differ from the sources'")
    return report


def plot(rows, model, path):
    """Seconds per refit against sources (linear: a flat cost per source is a straight line), and
    that cost beyond one source's refit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, per) = plt.subplots(1, 2, figsize=(9, 3.6))
    xs = [r["sources"] for r in rows]
    ax.plot(xs, [r["median_s"] for r in rows], "o-", label="refit (median)")
    for r in rows:
        ax.plot([r["sources"]] * len(r["run_medians_s"]), r["run_medians_s"], ".", color="grey")
    ax.set_xlabel("sources one destination reads from")
    ax.set_ylabel("seconds per refit (grey: each run)")
    ax.set_ylim(bottom=0)
    base = rows[0]["median_s"] if rows[0]["sources"] == 1 else None
    if base is not None:
        more = [r for r in rows if r["sources"] > 1]
        per.plot([r["sources"] for r in more], [1e3 * (r["median_s"] - base) / (r["sources"] - 1) for r in more], "o-")
    per.set_xlabel("sources")
    per.set_ylabel("ms per source beyond the first")
    per.set_ylim(bottom=0)
    for a in (ax, per):
        a.grid(True, alpha=0.3)
    fig.suptitle(f"{model}: FSDP shards, one destination, same bytes at every N")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--model", default="builtin:refit-tiny-moe")
    p.add_argument("--refits", type=int, default=6)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--replot", metavar="JSON", help="only plot the rows of an earlier --json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.replot:
        saved = json.load(open(args.replot))
        plot(saved["rows"], saved["model"], args.plot)
        return

    rows = []
    print(f"{'sources':>8} {'median s':>9} {'runs (median s)':>26} {'MiB':>8} {'ms per source':>14}")
    for n in args.sources:
        medians, bytes_ = [], 0
        for _ in range(args.runs):
            report = run(n, args)
            medians.append(statistics.median(refit_seconds(report)))
            bytes_ = sum(report["expected_bytes"])  # per destination
        median = statistics.median(medians)
        rows.append({"sources": n, "median_s": median, "run_medians_s": medians, "bytes": bytes_})
        print(f"{n:>8} {median:>9.4f} {' / '.join(f'{m:.4f}' for m in medians):>26} {bytes_ / 2**20:>8.1f} "
              f"{1e3 * median / n:>14.3f}")
    if args.json:
        json.dump({"model": args.model, "refits": args.refits, "overrides": args.overrides, "rows": rows},
                  open(args.json, "w"), indent=1)
    if args.plot:
        plot(rows, args.model, args.plot)


if __name__ == "__main__":
    main()
