"""refit's log from Python: on stderr (never stdout), in the driver and in the worker processes a
group spawns, and with REFIT_LOG_FORMAT=plain the reference's markers start the line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Optional

# A driver and a spawned source and destination process (refit.multiprocessing_group): the
# driver logs the bucket size and the backend, the destination process what it loaded.
REFIT = """
import refit
from refit.multiprocessing_group import ProcessWorkerGroup
from refit.testing import SyntheticPrograms, verify

print("the program's own output")
with ProcessWorkerGroup(1, 1, SyntheticPrograms(limit=40), framework="numpy") as group:
    report = refit.WeightSynchronizer({"timeout_s": 60, "bucket_bytes": 1 << 20}, group).sync_weights()
    assert verify(report.results, 1) == []
refit.log("warning", "[vLLM refit] from Python")
"""

MARKERS = r"\[vLLM refit\]|\[checkpoint engine\]|Using checkpoint-engine|\[(info|warning)\]"


def run_refit(log_format: Optional[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("REFIT_LOG_FORMAT", None)
    if log_format is not None:
        env["REFIT_LOG_FORMAT"] = log_format
    result = subprocess.run([sys.executable, "-c", REFIT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the program's own output\n"  # nothing of the log
    return result


def test_plain_format_starts_lines_with_the_reference_markers():
    err = run_refit("plain").stderr
    assert re.search(r"^\[vLLM refit\] Loaded 40 tensors in \d+ batches via checkpoint engine; bytes=", err, re.M), err
    assert re.search(r"^\[checkpoint engine\] Bucket size: 1 MiB per buffer", err, re.M), err
    assert re.search(r"^Using checkpoint-engine refit backend: nixl$", err, re.M), err
    assert re.search(r"^\[vLLM refit\] from Python$", err, re.M), err
    assert not re.search(r"^\[\d{4}-", err, re.M), err  # no line in the default format


def test_default_format_is_time_level_message_on_stderr():
    err = run_refit(None).stderr
    stamp = r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}\] "
    assert re.search(stamp + r"\[info\] \[vLLM refit\] Loaded 40 tensors", err, re.M), err
    assert re.search(stamp + r"\[info\] \[checkpoint engine\] Bucket size: 1 MiB", err, re.M), err
    assert re.search(stamp + r"\[info\] Using checkpoint-engine refit backend: nixl$", err, re.M), err
    assert re.search(stamp + r"\[warning\] \[vLLM refit\] from Python$", err, re.M), err
    assert not re.search(r"^(" + MARKERS + ")", err, re.M), err  # every line of the log is stamped
