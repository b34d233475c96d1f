#!/usr/bin/env python3
"""The Ray driver of python/tests/test_hosts_ray.py: it runs inside simulated host 1
(scripts/simhosts.sh exec TAG 1 ...), connects to a Ray cluster whose nodes live on simulated hosts
(`ray start` per host, custom resource "hostI" on host I), places policy and rollout actors on
hosts by those resources and drives refits with refit.WeightSynchronizer; every destination tensor
is checked bitwise (refit.testing: synthetic sources, hashing destinations, verify).

    hosts_ray_driver.py --address ADDR:PORT --scenario topology --policy-hosts 1,2 --rollout-hosts 3,4
    hosts_ray_driver.py --address ADDR:PORT --scenario loss ...      (interactive: see below)

It reports events one per line, "@@ " and a JSON object, on stdout or on the descriptor given by
--events-fd (stdout also carries Ray's and refit's logs, for a person). Scenario "loss" talks with the test:
    -> {"event": "mid_refit", ...}      the last rollout is holding a batch of refit 1: kill its host now
    -> {"event": "refit_failed", ...}   what the caller saw (error, time, stale synchronizer, survivors)
    -> {"event": "waiting_for_host"}    restart the host and `ray start` there again, then
    <- a line "host_ready" on stdin
    -> {"event": "refit", ...}          a refit with a replacement actor on the restarted host
Every wait has a deadline; the exit status is 0 when every step went as it should.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import ray

import refit
from refit.ray import RayWorkerGroup
from refit.testing import HashingDestination, SyntheticSource, verify


_events = sys.stdout  # --events-fd: a descriptor of its own (Ray writes the actors' output to stdout)


def emit(event: str, **fields: Any) -> None:
    _events.write("@@ " + json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def _where() -> Dict[str, Any]:
    return {"hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id()}


class PolicyActor(refit.EngineWorker):
    """A policy rank: synthetic weights of the default model (new bytes every refit)."""

    def __init__(self, rank: int):
        super().__init__("policy", rank, SyntheticSource())

    def where(self) -> Dict[str, Any]:
        return {**_where(), "role": self.role, "rank": self.rank, "has_engine": self.engine is not None}


class HoldingDestination(HashingDestination):
    """Hashes what arrives; in refit ``hold_at`` it tells ``signal`` after its first batch and then
    holds that batch for ``hold_s`` seconds (less than timeout_s), so that its host can be killed
    in the middle of the refit."""

    def __init__(self, signal: Any = None, hold_at: Optional[int] = None, hold_s: float = 0.0):
        super().__init__()
        self.signal, self.hold_at, self.hold_s = signal, hold_at, hold_s

    def load(self, index: int, batch) -> None:
        super().load(index, batch)
        if index == self.hold_at and self.batches == 1:
            ray.get(self.signal.notify.remote(socket.gethostname(), time.monotonic()))
            time.sleep(self.hold_s)


class RolloutActor(refit.EngineWorker):
    """A rollout rank: hashes every tensor it receives (a real one would load_weights(batch))."""

    def __init__(self, rank: int, signal: Any = None, hold_at: Optional[int] = None, hold_s: float = 0.0):
        super().__init__("rollout", rank, HoldingDestination(signal, hold_at, hold_s), framework="numpy")

    def where(self) -> Dict[str, Any]:
        return {**_where(), "role": self.role, "rank": self.rank, "has_engine": self.engine is not None}


class Signal:
    """Lives on host 1: a rollout actor tells it when it is in the middle of a refit."""

    def __init__(self) -> None:
        self.notes: List[Any] = []

    def notify(self, hostname: str, t: float) -> None:
        self.notes.append((hostname, t))

    def get(self) -> List[Any]:
        return list(self.notes)


class HostsRayWorkerGroup(RayWorkerGroup):
    """refit.ray's group with the test's own call: where each actor runs."""

    def where(self) -> List[Dict[str, Any]]:
        # The first call on each actor waits for its process to start: seconds on a loaded 2-core
        # host (15 s was seen to run out while a build shared the cores).
        return self.call_all("where", timeout_s=60)


def _options(host: int) -> Dict[str, Any]:
    # A small share of the host's resource: any number of actors per host, none elsewhere.
    return {"num_cpus": 0, "resources": {f"host{host}": 0.01}}


def refit_event(k: int, report: refit.RefitReport, group: HostsRayWorkerGroup) -> Dict[str, Any]:
    problems = verify(report.results, group.train_world_size)
    dests = report.destination_results
    return {
        "index": report.index, "seconds": report.seconds, "problems": problems[:20],
        "tensors": [r["stats"]["tensors"] for r in dests],
        "payload_bytes": [r["stats"]["payload_bytes"] for r in dests],
        "mapped": [r["stats"]["mapped"] for r in dests],
        "route": [r["stats"]["route"] for r in dests],
        "sources_had_peer": [r["stats"]["had_peer"] for r in report.source_results],
        "compared": sum(len(r["report"]["hashes"]) for r in dests),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="the Ray head, ADDR:PORT")
    p.add_argument("--scenario", choices=["topology", "loss"], required=True)
    p.add_argument("--policy-hosts", default="1,2", help="host of each policy actor, by rank")
    p.add_argument("--rollout-hosts", default="3,4", help="host of each rollout actor, by rank")
    p.add_argument("--nodes", type=int, default=4, help="wait (up to 60 s) until this many Ray nodes are alive")
    p.add_argument("--refits", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=10.0, help="refit's timeout_s")
    p.add_argument("--bucket", default="32MiB")
    p.add_argument("--hold-s", type=float, default=7.0, help="loss: how long the last rollout holds a batch")
    p.add_argument("--events-fd", type=int, default=None, help="write events to this descriptor")
    args = p.parse_args(argv)
    global _events
    if args.events_fd is not None:
        _events = os.fdopen(args.events_fd, "w")
    policy_hosts = [int(h) for h in args.policy_hosts.split(",")]
    rollout_hosts = [int(h) for h in args.rollout_hosts.split(",")]

    ray.init(address=args.address, logging_level="WARNING")
    waited = time.monotonic()
    while len([n for n in ray.nodes() if n["Alive"]]) < args.nodes and time.monotonic() - waited < 60:
        time.sleep(0.2)
    emit("connected", nodes=sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]),
         resources={k: v for k, v in ray.cluster_resources().items() if k.startswith("host")})
    config = {"bucket_bytes": args.bucket, "timeout_s": args.timeout_s}
    ok = True
    try:
        signal = ray.remote(Signal).options(**_options(1)).remote()
        last = len(rollout_hosts) - 1
        policy = [ray.remote(PolicyActor).options(**_options(h)).remote(rank)
                  for rank, h in enumerate(policy_hosts)]
        rollout = [ray.remote(RolloutActor).options(**_options(h)).remote(
                       rank, signal, 1 if args.scenario == "loss" and rank == last else None, args.hold_s)
                   for rank, h in enumerate(rollout_hosts)]
        group = HostsRayWorkerGroup(policy, rollout, timeout_s=args.timeout_s)
        placement = group.where()
        emit("placed", actors=placement)
        inventory = refit.load_model_inventory(refit.testing.default_model_path())
        sync = refit.WeightSynchronizer(config, group, model_fingerprint=inventory.fingerprint)
        emit("model", tensors=len(inventory.tensors), bytes=inventory.total_bytes)

        refits = args.refits if args.scenario == "topology" else 1
        for k in range(refits):
            event = refit_event(k, sync.sync_weights(), group)
            ok = ok and not event["problems"]
            emit("refit", **event)
        if args.scenario == "topology":
            sync.shutdown()
            return 0 if ok else 1

        # ---- loss: the last rollout's host dies in the middle of refit 1 ----
        outcome: Dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["report"] = sync.sync_weights()
            except BaseException as e:  # noqa: BLE001
                outcome["error"] = e
            outcome["t"] = time.monotonic()

        started = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        while not ray.get(signal.get.remote(), timeout=10):
            if time.monotonic() - started > 60 or not thread.is_alive():
                emit("error", message="the last rollout never reached the middle of refit 1")
                return 1
            time.sleep(0.02)
        emit("mid_refit", t=time.monotonic(), holder=ray.get(signal.get.remote(), timeout=10)[0][0])
        thread.join(args.timeout_s * 3 + 30)
        if thread.is_alive():
            emit("error", message=f"sync_weights() did not return within {args.timeout_s * 3 + 30} s of the kill")
            return 1
        error = outcome.get("error")
        emit("refit_failed", failed=error is not None, t=outcome["t"],
             error_type=type(error).__name__ if error else None,
             error=str(error) if error else None,
             notes=list(getattr(error, "__notes__", [])) if error else [],
             is_refit_error=isinstance(error, refit.RefitError),
             stale=sync.stale, ready=sync.ready, lost=sorted(group.lost))

        # The survivors answer, keep their engines, and are in no refit any more.
        survivors = [a for i, a in enumerate(group.actors) if i not in group.lost]
        answers = ray.get([a.where.remote() for a in survivors], timeout=15)
        emit("survivors", actors=answers)

        # The test restarts the host and its Ray node; a new rollout actor takes the lost one's place.
        emit("waiting_for_host")
        line = sys.stdin.readline().strip()
        if line != "host_ready":
            emit("error", message=f"expected 'host_ready' on stdin, got {line!r}")
            return 1
        host = rollout_hosts[last]
        # Ray offers the dead node's resources until its health check declares the node dead; an
        # actor placed before then can land on the dead node. Wait for that and for the new node.
        lost_node = placement[len(policy_hosts) + last]["node_id"]
        waited = time.monotonic()
        while True:
            nodes = ray.nodes()
            old_alive = any(n["NodeID"] == lost_node and n["Alive"] for n in nodes)
            new = [n for n in nodes if n["Alive"] and n["NodeID"] != lost_node and n["Resources"].get(f"host{host}")]
            if not old_alive and new:
                break
            if time.monotonic() - waited > 90:
                emit("error", message=f"Ray did not replace the node of host {host} within 90 s "
                                      f"(old node alive: {old_alive}, new nodes: {len(new)})")
                return 1
            time.sleep(0.2)
        emit("host_back", waited_s=time.monotonic() - waited, node_id=new[0]["NodeID"])
        replacement = ray.remote(RolloutActor).options(**_options(host)).remote(last)
        placed = ray.get(replacement.where.remote(), timeout=60)
        group.replace("rollout", last, replacement)
        emit("replaced", actor=placed)
        event = refit_event(2, sync.sync_weights(), group)
        ok = ok and not event["problems"]
        emit("refit", **event, stale=sync.stale)
        sync.shutdown()
        return 0 if ok else 1
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
