"""The Ray example with real Ray on CPU: a driver with 2 policy actors and 2 rollout actors runs
3 refits of the default model (refit-tiny-moe) and checks every tensor of every refit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

pytest.importorskip("ray", reason="Ray is not installed (pip install ray; scripts/test_python.sh installs it)")

EXAMPLE = os.path.join(REPO, "python", "examples", "ray_refit.py")


def test_ray_example_runs_three_verified_refits():
    env = dict(os.environ, RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # a local Ray of the test's own
    proc = subprocess.run([sys.executable, EXAMPLE, "--policy", "2", "--rollout", "2", "--refits", "3",
                           "timeout_s=120"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "2 policy -> 2 rollout actors, 3 refits" in out
    verified = [line for line in proc.stdout.splitlines() if line.startswith("refit ") and "verified: yes" in line]
    assert len(verified) == 3, out[-6000:]
    assert "all refits verified" in proc.stdout
    # The reference's log lines come through from the driver and the actors.
    assert "[checkpoint engine] Bucket size:" in out
    assert "Using checkpoint-engine refit backend: nixl" in out
    assert "[vLLM refit] Loaded 459 tensors" in out
