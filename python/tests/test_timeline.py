"""python -m refit.timeline: reading bench and plan JSON files, drawing the Gantt chart, the command
line. The files are small synthetic ones in the shapes `refit bench --json` and `refit plan --json`
write."""

import json
import os
import subprocess
import sys

import pytest

from refit.timeline import load_events, plot_timeline, worker_key

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


LINK_PHASES = ("pack", "announce", "read", "load", "release")


def link_events(source, destination, buckets, t0=0.0, step=0.01, phases=LINK_PHASES):
    """The events of `buckets` buckets on one link: bars for pack (source), read and load
    (destination), instants for announce and release (source)."""
    events = []
    for b in range(buckets):
        t = t0 + b * step
        for phase in phases:
            worker = f"destination {destination}" if phase in ("read", "load") else f"source {source}"
            peer = source if worker.startswith("destination") else destination
            start, end = {"pack": (t, t + 0.4 * step), "announce": (t + 0.4 * step,) * 2,
                          "read": (t + 0.4 * step, t + 0.7 * step), "load": (t + 0.7 * step, t + step),
                          "release": (t + step,) * 2}.get(phase, (t, t + 0.5 * step))
            events.append({"worker": worker, "phase": phase, "peer": peer, "bucket": b,
                           "start": start, "end": end, "bytes": 1 << 20})
    return events


def per_worker(events):
    counts = {}
    for e in events:
        counts[e["worker"]] = counts.get(e["worker"], 0) + 1
    return counts


def write_json(path, doc):
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def bench_file(tmp_path):
    refits = [
        {"index": 0, "seconds": 0.50, "ok": True, "timeline": link_events(0, 0, 3)},
        {"index": 1, "seconds": 0.52, "ok": True, "timeline": link_events(0, 0, 4)},
        {"index": 2, "seconds": 0.10, "ok": False, "timeline": link_events(0, 0, 1)},
    ]
    return write_json(tmp_path / "RUN.json", {"model": "tiny", "refits": refits})


@pytest.fixture
def plan_file(tmp_path):
    prediction = {"refit": {"seconds": 0.9, "timeline": link_events(0, 0, 5)},
                  "paired": {"seconds": 2.1, "timeline": link_events(0, 0, 2, phases=("gather", "pack", "read"))}}
    return write_json(tmp_path / "PLAN.json", {"prediction": prediction})


def assert_png(path):
    data = open(path, "rb").read()
    assert len(data) > 1000
    assert data[:8] == PNG_MAGIC


# --- reading --------------------------------------------------------------------------------------


def test_bench_file_defaults_to_the_last_ok_refit(bench_file):
    events, seconds, label = load_events(bench_file)
    assert seconds == 0.52  # refit 1: refit 2 failed
    assert len(events) == 4 * 5
    assert "refit 1" in label and "measured" in label


def test_bench_file_picks_the_refit_asked_for(bench_file):
    events, seconds, label = load_events(bench_file, refit=2)
    assert (len(events), seconds) == (5, 0.10)
    assert "failed" in label
    events, seconds, _ = load_events(bench_file, refit=0)
    assert (len(events), seconds) == (15, 0.50)


def test_plan_file_picks_the_path(plan_file):
    events, seconds, label = load_events(plan_file)
    assert (len(events), seconds) == (25, 0.9)
    assert "refit" in label and "predicted" in label
    events, seconds, label = load_events(plan_file, path_kind="paired")
    assert (len(events), seconds) == (6, 2.1)
    assert {e["phase"] for e in events} == {"gather", "pack", "read"}
    assert "paired" in label


def test_missing_refit_names_the_file_and_the_refits(bench_file):
    with pytest.raises(ValueError) as e:
        load_events(bench_file, refit=7)
    assert str(e.value) == f"{bench_file}: refit 7 not found (refits 0..2)"


def test_refit_without_timeline(tmp_path):
    path = write_json(tmp_path / "old.json", {"refits": [{"index": 0, "seconds": 0.4, "ok": True},
                                                         {"index": 1, "seconds": 0.4, "ok": True}]})
    with pytest.raises(ValueError,
                       match=r"old\.json: no timeline in refit 1: run refit bench with a build that records events"):
        load_events(path)


def test_no_ok_refit(tmp_path):
    path = write_json(tmp_path / "bad.json", {"refits": [{"index": 0, "ok": False, "timeline": link_events(0, 0, 1)}]})
    with pytest.raises(ValueError, match=r"bad\.json: no successful refit"):
        load_events(path)
    assert len(load_events(path, refit=0)[0]) == 5  # asked for, a failed refit is still drawn


def test_plan_without_the_path(tmp_path):
    path = write_json(tmp_path / "p.json", {"prediction": {"refit": {"seconds": 1, "timeline": link_events(0, 0, 1)}}})
    with pytest.raises(ValueError, match=r"p\.json: no 'paired' prediction \(has: refit\)"):
        load_events(path, path_kind="paired")
    with pytest.raises(ValueError, match="unknown path 'sideways'"):
        load_events(path, path_kind="sideways")
    with pytest.raises(ValueError, match="plan file has no refits"):
        load_events(path, refit=0)


def test_neither_kind_nor_json(tmp_path):
    with pytest.raises(ValueError, match=r"x\.json: neither .* nor "):
        load_events(write_json(tmp_path / "x.json", {"something": 1}))
    (tmp_path / "y.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"y\.json: not JSON"):
        load_events(str(tmp_path / "y.json"))


def test_event_without_a_required_key(tmp_path):
    events = link_events(0, 0, 1)
    del events[3]["start"]
    path = write_json(tmp_path / "e.json", {"refits": [{"index": 0, "ok": True, "timeline": events}]})
    with pytest.raises(ValueError, match=r"e\.json, refit 0: event 3 has no 'start'"):
        load_events(path)


# --- drawing --------------------------------------------------------------------------------------


def test_worker_order_is_role_then_integer_rank():
    workers = ["destination 10", "source 10", "destination 2", "source 2", "source 0", "destination 0"]
    assert sorted(workers, key=worker_key) == ["source 0", "source 2", "source 10",
                                               "destination 0", "destination 2", "destination 10"]


def test_plot_measured_alone_counts_every_event(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/test_python.sh installs it)")
    # Three links, the ranks chosen so that a string sort would put 10 before 2.
    events = link_events(2, 2, 4) + link_events(10, 10, 7) + link_events(0, 0, 1)
    out = str(tmp_path / "m.png")
    summary = plot_timeline(measured=events, out=out, title="three links")
    assert_png(out)
    assert summary["out"] == out
    assert summary["rows"] == ["source 0", "source 2", "source 10", "destination 0", "destination 2", "destination 10"]
    assert summary["measured"] == per_worker(events)
    assert summary["measured"]["source 10"] == 7 * 3 and summary["measured"]["destination 2"] == 4 * 2
    assert "predicted" not in summary


def test_plot_measured_and_predicted(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/test_python.sh installs it)")
    measured = link_events(0, 0, 3) + link_events(1, 1, 2)
    # The prediction has a worker the run lacks, and a phase no colour is assigned to.
    predicted = link_events(0, 0, 3, phases=("gather", "pack", "read", "load", "verify")) + link_events(2, 1, 1)
    out = str(tmp_path / "both.png")
    summary = plot_timeline(measured, predicted, out=out, measured_seconds=0.05, predicted_seconds=0.07)
    assert_png(out)
    assert summary["rows"] == ["source 0", "source 1", "source 2", "destination 0", "destination 1"]
    assert summary["measured"] == per_worker(measured)
    assert summary["predicted"] == per_worker(predicted)
    assert "source 2" not in summary["measured"]


def test_plot_many_buckets(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/test_python.sh installs it)")
    events = [e for s in range(4) for e in link_events(s, s, 2000, step=0.0005)]
    out = str(tmp_path / "many.png")
    summary = plot_timeline(measured=events, out=out)
    assert_png(out)
    assert sum(summary["measured"].values()) == len(events) == 4 * 2000 * 5


def test_plot_needs_events():
    with pytest.raises(ValueError, match="give measured or predicted"):
        plot_timeline(out="never.png")


# --- the command line -----------------------------------------------------------------------------


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "refit.timeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_bench_with_prediction(tmp_path, bench_file, plan_file):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/test_python.sh installs it)")
    out = str(tmp_path / "cmp.png")
    r = run_cli(bench_file, "--refit", "0", "--predicted", plan_file, "--path", "paired", "-o", out, "--title", "T",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == out
    assert_png(out)


def test_cli_plan_alone_default_output(tmp_path, plan_file):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/test_python.sh installs it)")
    r = run_cli(plan_file, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "timeline.png"
    assert_png(os.path.join(tmp_path, "timeline.png"))


@pytest.mark.parametrize("args, message", [
    (["{bench}", "--refit", "7"], "{bench}: refit 7 not found (refits 0..2)"),
    (["{plan}", "--predicted", "{plan}"], "a plan file; --predicted goes with"),
    (["{bench}", "--predicted", "{bench}"], "{bench}: not a `refit plan --json` file"),
    (["{missing}"], "No such file or directory"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, bench_file, plan_file, args, message):
    names = {"bench": bench_file, "plan": plan_file, "missing": str(tmp_path / "missing.json")}
    r = run_cli(*[a.format(**names) for a in args], "-o", str(tmp_path / "no.png"), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refit.timeline: error: "), r.stderr
    assert message.format(**names) in lines[0]
    assert not os.path.exists(tmp_path / "no.png")
