"""Ray across simulated hosts: a Ray cluster whose head and worker nodes live on different hosts
(scripts/simhosts.sh: a network, mount, IPC, PID and UTS namespace per host), one custom resource
per host ("hostI"), policy actors on some hosts and rollout actors on others, refits driven by
refit.WeightSynchronizer from a driver that runs on host 1 and connects with
ray.init(address=...). Every destination tensor is checked bitwise, and every destination's bytes
must have come over the network (`mapped` false, `route` "UCX tcp/eth0").

- 2 -> 2: policy on hosts 1-2, rollout on hosts 3-4;
- 4 -> 2: two policy actors per host on hosts 1-2 (sources 2 and 3 have no destination);
- a lost host: every process of host 4 is killed in the middle of a refit; the refit fails within
  timeout_s with an error naming the lost peer and its host, the synchronizer is stale, the
  survivors answer; host 4 comes back (a fresh host, `ray start` again), a new rollout actor takes
  the lost one's place and the next refit is verified.

The driver is python/tests/hosts_ray_driver.py; it reports events as JSON lines ("@@ {...}") on a
pipe of their own.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import string
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

from helpers import REPO

pytest.importorskip("ray", reason="Ray is not installed (pip install ray; scripts/test_python.sh installs it)")

SIMHOSTS = os.path.join(REPO, "scripts", "simhosts.sh")
DRIVER = os.path.join(REPO, "python", "tests", "hosts_ray_driver.py")
PYTHON = sys.executable
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
HOSTS = 4
PORT = 6379
TIMEOUT_S = 10  # refit's timeout_s in these tests: the deadline of every wait


def _simhosts_problem() -> Optional[str]:
    if not os.path.exists(SIMHOSTS):
        return f"{SIMHOSTS} is missing"
    try:
        proc = subprocess.run([SIMHOSTS, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"simhosts.sh check could not run: {e}"
    if proc.returncode != 0:
        return (proc.stdout + proc.stderr).strip() or f"simhosts.sh check exited with {proc.returncode}"
    return None


class Cluster:
    """Four simulated hosts with a Ray node on each; the head on host 1."""

    def __init__(self, tag: str, log_dir: str):
        self.tag = tag
        self.log_dir = log_dir
        # Ray's token authentication with a token of this run's own, handed to every node and to
        # the driver by environment (nothing read from or written to ~/.ray).
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
                        RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0", SIMHOSTS_OWNER=str(os.getpid()))
        self.env.pop("RAY_ADDRESS", None)
        self.addresses: Dict[int, str] = {}
        self.timings: Dict[str, float] = {}

    def simhosts(self, *args: str, timeout: float = 60) -> str:
        proc = subprocess.run([SIMHOSTS, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"simhosts.sh {' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc.stdout.strip()

    def addr(self, host: int) -> str:
        if host not in self.addresses:
            self.addresses[host] = self.simhosts("addr", self.tag, str(host))
        return self.addresses[host]

    @property
    def head(self) -> str:
        return f"{self.addr(1)}:{PORT}"

    def _ray_start_command(self, host: int) -> List[str]:
        common = [f"--node-ip-address={self.addr(host)}", f"--resources={json.dumps({f'host{host}': 1})}",
                  "--num-cpus=1", f"--object-store-memory={96 << 20}", "--disable-usage-stats"]
        if host == 1:
            # Faster health checks than Ray's default (3 s x 5): a dead node is declared dead, and its
            # resources withdrawn, about 3 s after it stops answering.
            system = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
            return [RAY, "start", "--head", f"--port={PORT}", "--include-dashboard=false",
                    f"--system-config={json.dumps(system)}", *common]
        return [RAY, "start", f"--address={self.head}", *common]

    def start_ray(self, hosts: List[int], label: str) -> None:
        """`ray start` on each host (in parallel), inside that host."""
        start = time.monotonic()
        procs = []
        for host in hosts:
            log = open(os.path.join(self.log_dir, f"ray-start-h{host}-{label.replace(' ', '-')}.log"), "w")
            procs.append((host, log, subprocess.Popen([SIMHOSTS, "exec", self.tag, str(host),
                                                       *self._ray_start_command(host)],
                                                      cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)))
        failures = []
        for host, log, proc in procs:
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            log.close()
            if rc != 0:
                failures.append(f"host {host}: ray start -> {rc}: {open(log.name).read()[-3000:]}")
        assert not failures, "\n".join(failures)
        self.timings[label] = time.monotonic() - start


class Driver:
    """hosts_ray_driver.py on host 1; its events are read on a thread, with a deadline each."""

    def __init__(self, cluster: Cluster, name: str, *args: str):
        self.log_path = os.path.join(cluster.log_dir, f"driver-{name}.log")
        self.log = open(self.log_path, "w")
        # Events come on a pipe of their own: stdout and stderr carry Ray's and refit's logs.
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [SIMHOSTS, "exec", cluster.tag, "1", PYTHON, DRIVER, "--address", cluster.head,
                 "--timeout-s", str(TIMEOUT_S), "--events-fd", str(write_fd), *args],
                cwd=REPO, env=cluster.env, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                text=True, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self.pipe = os.fdopen(read_fd, "r")
        self.events: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.seen: List[Dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.pipe:
            try:
                self.events.put(json.loads(line[3:]) if line.startswith("@@ ") else
                                {"event": "error", "message": f"not an event: {line!r}"})
            except ValueError as e:
                self.events.put({"event": "error", "message": f"bad event {line!r}: {e}"})
        self.events.put({"event": "exit"})

    def tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "--- the driver's output:\n" + f.read()[-6000:]

    def expect(self, event: str, timeout: float) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                e = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no '{event}' from the driver within {timeout} s; events so far: "
                                     f"{[x['event'] for x in self.seen]}\n{self.tail()}") from None
            self.seen.append(e)
            if e["event"] == event:
                return e
            if e["event"] in ("error", "exit"):
                raise AssertionError(f"driver: {e} while waiting for '{event}'\n{self.tail()}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"the driver did not exit within {timeout} s\n{self.tail()}") from None
        self.reader.join(10)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        self.reader.join(5)
        if not self.reader.is_alive():
            self.pipe.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    problem = _simhosts_problem()
    if problem:
        pytest.skip(f"simulated hosts are not available here: {problem}")
    subprocess.run([SIMHOSTS, "clean"], cwd=REPO, capture_output=True, timeout=120)
    tag = "ry" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(4))
    c = Cluster(tag, str(tmp_path_factory.mktemp("hosts_ray")))
    try:
        start = time.monotonic()
        c.simhosts("up", tag, str(HOSTS), timeout=120)
        c.timings["simhosts up"] = time.monotonic() - start
        c.start_ray([1], "ray head on host 1")
        c.start_ray(list(range(2, HOSTS + 1)), f"ray nodes on hosts 2-{HOSTS}")
        yield c
    finally:
        # Killing a host kills its Ray node, its actors and the driver; down removes the links.
        subprocess.run([SIMHOSTS, "down", tag], cwd=REPO, capture_output=True, timeout=120)


def _check_refit(event: Dict[str, Any], destinations: int) -> None:
    assert event["problems"] == [], event["problems"]
    assert event["tensors"] == [459] * destinations  # refit-tiny-moe, every tensor hashed on both sides
    assert event["compared"] == 459 * destinations
    # Between hosts nothing is mapped: each destination's bytes came over the simulated network.
    assert event["mapped"] == [False] * destinations
    assert event["route"] == ["UCX tcp/eth0"] * destinations


def _run_topology(cluster: Cluster, name: str, policy_hosts: List[int], rollout_hosts: List[int],
                  capsys) -> None:
    driver = Driver(cluster, name, "--scenario", "topology", "--refits", "2",
                    "--policy-hosts", ",".join(map(str, policy_hosts)),
                    "--rollout-hosts", ",".join(map(str, rollout_hosts)))
    try:
        connected = driver.expect("connected", 90)
        assert len(connected["nodes"]) == HOSTS, connected
        assert connected["resources"] == {f"host{i}": 1.0 for i in range(1, HOSTS + 1)}
        placed = driver.expect("placed", 90)["actors"]
        # Each actor runs on the host its custom resource names.
        assert [a["hostname"] for a in placed] == [f"{cluster.tag}-h{h}" for h in policy_hosts + rollout_hosts]
        assert [a["node_ip"] for a in placed] == [cluster.addr(h) for h in policy_hosts + rollout_hosts]
        seconds = []
        for k in range(2):
            event = driver.expect("refit", 120)
            _check_refit(event, len(rollout_hosts))
            # Source i feeds destination i; sources without a destination only drain their weights.
            assert event["sources_had_peer"] == [i < len(rollout_hosts) for i in range(len(policy_hosts))]
            seconds.append(event["seconds"])
        assert driver.finish() == 0, driver.tail()
    finally:
        driver.close()
    with capsys.disabled():
        print(f"\n[hosts_ray] {len(policy_hosts)} -> {len(rollout_hosts)} across hosts: 2 refits verified, "
              f"{', '.join(f'{s:.2f}' for s in seconds)} s each (UCX tcp/eth0, not mapped)")


def test_two_policy_to_two_rollout_hosts(cluster, capsys):
    _run_topology(cluster, "2to2", [1, 2], [3, 4], capsys)


def test_four_policy_to_two_rollout_hosts(cluster, capsys):
    # Two policy actors per host (2 cores here); sources 2 and 3 send to no one.
    _run_topology(cluster, "4to2", [1, 2, 1, 2], [3, 4], capsys)


def test_lost_rollout_host_fails_the_refit_then_a_replacement_is_refit(cluster, capsys):
    driver = Driver(cluster, "loss", "--scenario", "loss", "--policy-hosts", "1,2", "--rollout-hosts", "3,4",
                    "--hold-s", str(TIMEOUT_S - 3))
    try:
        driver.expect("connected", 90)
        _check_refit(driver.expect("refit", 120), 2)
        # The rollout actor on host 4 holds a batch of the next refit: its host dies now.
        driver.expect("mid_refit", 120)
        killed = time.monotonic()  # CLOCK_MONOTONIC is one clock for every host (no time namespace)
        cluster.simhosts("kill", cluster.tag, "4")
        failed = driver.expect("refit_failed", TIMEOUT_S * 3 + 40)
        detection = failed["t"] - killed
        assert failed["failed"], failed
        # The caller gets source rank 1's own error, naming the lost peer and its host.
        assert failed["error_type"] == "PeerLostError" and failed["is_refit_error"], failed
        assert f"destination rank 1 on host {cluster.tag}-h4" in failed["error"], failed
        assert "source rank 1" in failed["error"], failed
        assert any("destination rank 1" in note for note in failed["notes"]), failed
        # Source 0 and destination 0 finished their refit: nothing else failed.
        assert not any("rank 0" in note for note in failed["notes"]), failed
        assert detection < TIMEOUT_S, f"the refit failed {detection:.1f} s after the kill (timeout_s={TIMEOUT_S})"
        assert failed["stale"] and not failed["ready"], failed
        assert failed["lost"] == [3], failed  # destination rank 1's actor, nothing else
        # The survivors answer and keep their engines.
        survivors = driver.expect("survivors", 30)["actors"]
        assert [(a["hostname"], a["has_engine"]) for a in survivors] == \
            [(f"{cluster.tag}-h{h}", True) for h in (1, 2, 3)]

        # Host 4 comes back: a fresh host with the same address, and a Ray node on it again.
        driver.expect("waiting_for_host", 30)
        start = time.monotonic()
        cluster.simhosts("restart", cluster.tag, "4")
        cluster.start_ray([4], "ray node on restarted host 4")
        restart_s = time.monotonic() - start
        driver.send("host_ready")
        back = driver.expect("host_back", 120)
        replaced = driver.expect("replaced", 90)["actor"]
        assert replaced["hostname"] == f"{cluster.tag}-h4" and replaced["node_id"] == back["node_id"]
        event = driver.expect("refit", 120)
        _check_refit(event, 2)
        assert event["stale"] is False
        assert driver.finish() == 0, driver.tail()
    finally:
        driver.close()
    with capsys.disabled():
        print(f"\n[hosts_ray] host 4 killed mid-refit: refit failed after {detection:.2f} s "
              f"(timeout_s={TIMEOUT_S}): {failed['error_type']}: {failed['error']}")
        print(f"[hosts_ray] host 4 restarted with its Ray node in {restart_s:.1f} s; Ray dropped the dead node "
              f"{back['waited_s']:.1f} s after that; the replacement rollout actor's refit was verified "
              f"({event['seconds']:.2f} s)")
        print("[hosts_ray] cluster: " + ", ".join(f"{k} {v:.1f} s" for k, v in cluster.timings.items()))
