"""Per-bucket timelines of a refit, drawn as a Gantt chart: one row per worker, one bar per bucket
and phase (pack, read, load...), so a measured run (`refit bench --json`) and the planner's
prediction (`refit plan --json`) can be seen, and compared, on one chart.

    python -m refit.timeline RUN.json [--refit K] [--predicted PLAN.json] [--path refit|paired] [-o OUT.png]
    python -m refit.timeline PLAN.json [--path refit|paired] [-o OUT.png]

An event is {"worker": "source 0", "phase": "read", "peer": 1, "bucket": 3, "start": s, "end": s,
"bytes": n}, times in seconds since the refit began; announce and release are instants (start ==
end). matplotlib is imported only when drawing, so `import refit` never needs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

Event = Dict[str, Any]

# Phases in the order an engine goes through them (also the legend's order). A phase not listed
# (a producer newer than this module) is still drawn, in a fallback colour.
PHASE_COLOURS = {
    "gather": "tab:purple",
    "pack": "tab:blue",
    "announce": "black",
    "read": "tab:orange",
    "load": "tab:green",
    "release": "tab:red",
}
FALLBACK_COLOURS = ["tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
PATH_KINDS = ("refit", "paired")
REQUIRED_KEYS = ("worker", "phase", "start", "end")
ROLE_ORDER = {"source": 0, "destination": 1}


def _read(path: str) -> Tuple[dict, str]:
    """The document and its kind, "bench" or "plan", told apart by their top-level keys."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if isinstance(doc, dict) and "refits" in doc:
        return doc, "bench"
    if isinstance(doc, dict) and "prediction" in doc:
        return doc, "plan"
    raise ValueError(f"{path}: neither a `refit bench --json` file (no 'refits') "
                     f"nor a `refit plan --json` file (no 'prediction')")


def _check_events(events: Any, where: str) -> List[Event]:
    # Fail here, naming the file and event, rather than deep inside matplotlib.
    if not isinstance(events, list):
        raise ValueError(f"{where}: the timeline is not a list of events")
    for i, e in enumerate(events):
        missing = [k for k in REQUIRED_KEYS if not isinstance(e, dict) or k not in e]
        if missing:
            raise ValueError(f"{where}: event {i} has no {', '.join(repr(k) for k in missing)}")
    return events


def _bench_events(path: str, doc: dict, refit: Optional[int]) -> Tuple[List[Event], Optional[float], str]:
    refits = doc["refits"]
    if not isinstance(refits, list) or not all(isinstance(r, dict) for r in refits):
        raise ValueError(f"{path}: 'refits' is not a list of objects")
    if not refits:
        raise ValueError(f"{path}: no refits")
    indices = [r.get("index", i) for i, r in enumerate(refits)]
    if refit is None:
        # The last refit that worked: a failed one stops early and shows only part of the picture.
        ok = [r for r in refits if r.get("ok", True)]
        if not ok:
            raise ValueError(f"{path}: no successful refit (refits {min(indices)}..{max(indices)} all failed); "
                             f"pick one with --refit")
        chosen = ok[-1]
    else:
        matches = [r for r, i in zip(refits, indices) if i == refit]
        if not matches:
            raise ValueError(f"{path}: refit {refit} not found (refits {min(indices)}..{max(indices)})")
        chosen = matches[0]
    index = chosen.get("index", refits.index(chosen))
    events = chosen.get("timeline")
    if not events:
        raise ValueError(f"{path}: no timeline in refit {index}: run refit bench with a build that records events")
    label = f"measured (refit {index}{'' if chosen.get('ok', True) else ', failed'})"
    return _check_events(events, f"{path}, refit {index}"), chosen.get("seconds"), label


def _plan_events(path: str, doc: dict, path_kind: str) -> Tuple[List[Event], Optional[float], str]:
    if path_kind not in PATH_KINDS:
        raise ValueError(f"{path}: unknown path {path_kind!r} (expected refit or paired)")
    prediction = doc["prediction"] or {}
    if not isinstance(prediction, dict) or not all(isinstance(p, dict) for p in prediction.values()):
        raise ValueError(f"{path}: 'prediction' is not an object of paths")
    if path_kind not in prediction:
        has = ", ".join(sorted(prediction)) or "none"
        raise ValueError(f"{path}: no {path_kind!r} prediction (has: {has})")
    events = prediction[path_kind].get("timeline")
    if not events:
        raise ValueError(f"{path}: no timeline in the {path_kind} prediction: "
                         f"run refit plan with a build that records events")
    label = f"predicted ({path_kind} path)"
    return _check_events(events, f"{path}, {path_kind} prediction"), prediction[path_kind].get("seconds"), label


def load_events(path: str, refit: Optional[int] = None,
                path_kind: str = "refit") -> Tuple[List[Event], Optional[float], str]:
    """(events, seconds, label) from a `refit bench --json` file (refit `refit`, default the last
    ok one) or a `refit plan --json` file (the `path_kind` prediction, "refit" or "paired").
    Raises ValueError naming the file and what is missing."""
    doc, kind = _read(path)
    if kind == "bench":
        return _bench_events(path, doc, refit)
    if refit is not None:
        raise ValueError(f"{path}: a plan file has no refits (--refit applies to a `refit bench --json` file)")
    return _plan_events(path, doc, path_kind)


def worker_key(worker: str) -> Tuple[int, str, int]:
    """Sources first, then destinations, each by integer rank (source 10 after source 2); any
    other name after them."""
    role, _, rank = worker.partition(" ")
    if role in ROLE_ORDER and rank.isdigit():
        return ROLE_ORDER[role], role, int(rank)
    return len(ROLE_ORDER), worker, -1


def _colours(phases: Sequence[str]) -> Dict[str, str]:
    colours = {p: c for p, c in PHASE_COLOURS.items() if p in phases}
    others = sorted(p for p in phases if p not in PHASE_COLOURS)
    for i, p in enumerate(others):
        colours[p] = FALLBACK_COLOURS[min(i, len(FALLBACK_COLOURS) - 1)]
    return colours


def _span(events: List[Event]) -> float:
    return max((float(e["end"]) for e in events), default=0.0)


def plot_timeline(measured: Optional[List[Event]] = None, predicted: Optional[List[Event]] = None,
                  out: str = "timeline.png", title: Optional[str] = None, *,
                  measured_seconds: Optional[float] = None, predicted_seconds: Optional[float] = None,
                  measured_label: str = "measured", predicted_label: str = "predicted") -> dict:
    """Draws a Gantt chart of one or two timelines to `out` (PNG, or any format matplotlib writes
    by the extension). Returns {"out": out, "rows": [worker, top row first], "measured": {worker:
    events drawn}, "predicted": {...}} (a series' key only when it was given)."""
    series = [(name, _check_events(ev, name), secs, label)
              for name, ev, secs, label in (("measured", measured, measured_seconds, measured_label),
                                            ("predicted", predicted, predicted_seconds, predicted_label))
              if ev is not None]
    if not series:
        raise ValueError("plot_timeline: give measured or predicted events (or both)")
    try:  # lazily: only drawing needs matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(f"drawing a timeline needs matplotlib (pip install matplotlib): {e}") from e

    rows = sorted({str(e["worker"]) for _, ev, _, _ in series for e in ev}, key=worker_key)
    phases = {str(e["phase"]) for _, ev, _, _ in series for e in ev}
    colours = _colours(list(phases))
    # Row i's centre is at y = n-1-i so the first worker is on top. With two series, measured
    # fills the upper half of each row and predicted the lower (hatched, lighter).
    centre = {w: len(rows) - 1 - i for i, w in enumerate(rows)}
    halves = {"measured": (0.0, 0.4), "predicted": (-0.4, 0.0)} if len(series) == 2 else None
    style = {"measured": dict(alpha=1.0), "predicted": dict(alpha=0.55, hatch="///", edgecolor="0.25")}

    # A figure without pyplot, on the Agg canvas: no display, no global backend to switch.
    fig = Figure(figsize=(12, max(2.5, 0.35 * len(rows) + 1.6)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    summary: dict = {"out": out, "rows": rows}
    instants_only = {p: True for p in phases}
    for name, events, _, _ in series:
        lo, hi = halves[name] if halves else (-0.4, 0.4)
        # One broken_barh / plot call per worker and phase, not per event: a worker with
        # thousands of buckets draws as fast as one with a few.
        groups: Dict[Tuple[str, str], List[Event]] = defaultdict(list)
        for e in events:
            groups[(str(e["worker"]), str(e["phase"]))].append(e)
        drawn: Dict[str, int] = defaultdict(int)
        for (worker, phase), group in groups.items():
            y = centre[worker]
            bars = [(float(e["start"]), float(e["end"]) - float(e["start"]))
                    for e in group if float(e["end"]) > float(e["start"])]
            instants = [float(e["start"]) for e in group if float(e["end"]) <= float(e["start"])]
            if bars:
                instants_only[phase] = False
                ax.broken_barh(bars, (y + lo, hi - lo), facecolors=colours[phase], linewidth=0, zorder=2,
                               **style[name])
            if instants:
                # Thin vertical ticks as one line broken by NaNs (far faster than vlines for
                # thousands), behind the bars so that dense instants do not hide them.
                xs = [v for t in instants for v in (t, t, float("nan"))]
                ys = [y + lo, y + hi, float("nan")] * len(instants)
                ax.plot(xs, ys, color=colours[phase], linewidth=0.8, zorder=1, alpha=style[name]["alpha"],
                        linestyle="-" if name == "measured" else ":")
            drawn[worker] += len(bars) + len(instants)
        summary[name] = {w: drawn[w] for w in rows if w in drawn}

    ax.set_yticks([centre[w] for w in rows])
    ax.set_yticklabels(rows)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    end = max(max(_span(ev), secs or 0.0) for _, ev, secs, _ in series)
    ax.set_xlim(0, end * 1.02 if end > 0 else 1)
    ax.set_xlabel("seconds since the refit began")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)

    handles = [Line2D([], [], color=colours[p], linewidth=1.5, label=f"{p} (instant)") if instants_only[p]
               else Patch(facecolor=colours[p], label=p) for p in colours]
    if halves:
        handles += [Patch(facecolor="white", edgecolor="black", label=f"upper half: {series[0][3]}"),
                    Patch(facecolor="white", edgecolor="0.25", hatch="///", label=f"lower half: {series[1][3]}")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")

    totals = ", ".join(f"{label} {secs if secs is not None else _span(ev):.3f} s" for _, ev, secs, label in series)
    ax.set_title(f"{title or 'refit timeline'}\n{totals}", fontsize="medium")
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m refit.timeline",
        description="Draw a refit's per-bucket timeline (refit bench --json) and/or a prediction "
                    "(refit plan --json) as a Gantt chart.")
    parser.add_argument("file", metavar="RUN_OR_PLAN.json",
                        help="a `refit bench --json` file, or a `refit plan --json` file "
                             "(drawn as the prediction alone)")
    parser.add_argument("--refit", type=int, help="the bench refit to draw (default: the last ok one)")
    parser.add_argument("--predicted", metavar="PLAN.json", help="a `refit plan --json` file drawn under the run")
    parser.add_argument("--path", choices=PATH_KINDS, default="refit", help="which predicted path (default: refit)")
    parser.add_argument("-o", "--out", default="timeline.png", help="the image to write (default: timeline.png)")
    parser.add_argument("--title", help="the chart's title")
    args = parser.parse_args(argv)
    try:
        doc, kind = _read(args.file)
        measured = predicted = None
        if kind == "plan":
            if args.predicted:
                raise ValueError(f"{args.file}: a plan file; --predicted goes with a `refit bench --json` file")
            if args.refit is not None:
                raise ValueError(f"{args.file}: a plan file has no refits "
                                 f"(--refit applies to a `refit bench --json` file)")
            predicted = _plan_events(args.file, doc, args.path)
        else:
            measured = _bench_events(args.file, doc, args.refit)
            if args.predicted:
                pdoc, pkind = _read(args.predicted)
                if pkind != "plan":
                    raise ValueError(f"{args.predicted}: not a `refit plan --json` file (no 'prediction')")
                predicted = _plan_events(args.predicted, pdoc, args.path)
        kwargs = {}
        for name, loaded in (("measured", measured), ("predicted", predicted)):
            if loaded:
                kwargs.update({name: loaded[0], f"{name}_seconds": loaded[1], f"{name}_label": loaded[2]})
        plot_timeline(out=args.out, title=args.title, **kwargs)
    except (ValueError, OSError) as e:
        print(f"refit.timeline: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"refit.timeline: {e}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
