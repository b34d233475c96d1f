"""NIXL as refit's transport (``backend_name: NIXL``), for deployments that already run NIXL.

refit's engine (buckets, double buffering, checksums, resharding) stays the same; NIXL moves the
bytes. Each engine owns one NIXL agent:

- memory: the transfer buffers are registered with the agent (``DRAM``, or ``VRAM`` with
  ``device: cuda``); a region's key for peers is the agent's partial metadata for it, which a
  peer loads once before its first read there;
- peers: the agent's metadata travels inside refit's own metadata (the transport address), and
  connecting loads it (``add_remote_agent``) and opens the connection at once;
- data: a destination READs a bucket from its source's buffer (``initialize_xfer`` +
  ``transfer``) and checks it with ``check_xfer_state``;
- control: refit's small messages (bucket manifests, acknowledgements) are NIXL notifications,
  numbered so that they are handed over in order.

Configuration (``refit_cfg.nixl``): ``backend_name: NIXL``; ``backend_init_params`` go to NIXL's
``create_backend`` as strings, as the reference passes them, except ``backend``, which names the
NIXL plugin (default ``UCX``; ``LIBFABRIC``, ``Mooncake``... where installed).

The agent is made without NIXL's progress thread and without its listener thread. The progress
thread spins a core even when idle, and refit does not need it: every wait of refit's engine
polls the agent (each ``check_xfer_state`` and ``get_new_notifs`` progresses it), and a source is
always inside such a wait while its destinations read from it, since ``send_weights`` returns only
once they have read everything. Every wait has refit's deadline (``timeout_s``). A peer that went
away is found by a heartbeat notification sent every half second while a message is awaited: NIXL
refuses it once the connection is lost, and the wait raises PeerLostError naming the peer.

NIXL is optional: ``pip install nixl-cu12`` (CUDA 12) or ``nixl-cu13`` (CUDA 13); both run on CPU
machines (add ``--no-deps`` to leave PyTorch out). Without it, asking for ``backend_name: NIXL``
raises UnsupportedError saying so.
"""

from __future__ import annotations

import importlib
import itertools
import os
import socket
import struct
import time
import uuid
from typing import Any, Dict, List, Optional

from . import _refit

#: The NIXL Python packages tried, in order: the CUDA 13 and CUDA 12 wheels, then a NIXL built
#: from source (module ``nixl``).
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")

#: backend_init_params keys refit reads itself; the rest go to NIXL's create_backend.
#: ``device`` is refit's (the engine's device, passed to every backend). ``read_source_memory``
#: ("true" or "false", the default): with direct_reads, destinations READ the sources' large
#: tensors from their own memory (one transfer per bucket, its reads as descriptors) instead of
#: the sources packing them. Off by default: on one host it measured no faster than buckets
#: (docs/PYTHON.md); it is for sources on other hosts, where packing is what costs.
REFIT_PARAMS = tuple(row["name"] for row in _refit.config_keys()
                     if row["scope"] == "backend_init_params" and "NIXL" in row["backends"].split())

# A control message: kind, then (for a message) its number in the pair's sequence.
_MESSAGE = 0
_HEARTBEAT = 1
_HEADER = struct.Struct("<BQ")
# A region key: memory type (0 DRAM, 1 VRAM) and device id, then the agent's partial metadata.
_KEY = struct.Struct("<BI")
_MEMORY_TYPES = ("DRAM", "VRAM")
_HEARTBEAT_EVERY_S = 0.5


def _leave_out_unusable_efa() -> None:
    """NIXL's wheels bundle UCX with its EFA module but not libefa, which that module loads from the
    system. Where the system has its own libefa (Debian's rdma-core has), it brings a second
    libibverbs and libnl into the process, and the two libnl copies crash the process as it exits
    (NIXL alone does it: SIGSEGV in rtnl_tc_unregister). Without an EFA device the module has
    nothing to do, so refit leaves it out there, unless UCX_MODULES is set already. Must run before
    NIXL's UCX loads."""
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not any("efa" in device for device in devices):
        os.environ["UCX_MODULES"] = "^efa"


def load_nixl():
    """NIXL's Python module (with ``nixl_agent`` and ``nixl_agent_config``), or UnsupportedError
    saying what to install."""
    _leave_out_unusable_efa()
    errors = []
    for name in NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if hasattr(module, "nixl_agent"):
            return module
        try:  # NIXL built from source exposes its API in nixl._api
            return importlib.import_module(name + "._api")
        except ImportError as e:
            errors.append(f"{name}._api: {e}")
    raise _refit.UnsupportedError(
        "refit_cfg.nixl.backend_name NIXL needs NIXL's Python package, which is not installed: "
        "pip install nixl-cu12 (CUDA 12) or nixl-cu13 (CUDA 13), with --no-deps to leave PyTorch out "
        f"(tried {'; '.join(errors)})")


def nixl_available() -> Optional[str]:
    """None when NIXL can be used here, else why not."""
    try:
        load_nixl()
    except _refit.UnsupportedError as e:
        return str(e)
    return None


def _disconnected(error: BaseException) -> bool:
    return "RemoteDisconnect" in type(error).__name__ or "REMOTE_DISCONNECT" in str(error)


class _Peer:
    def __init__(self, agent: str, label: str):
        self.agent = agent
        self.label = label
        self.next_send = 0
        self.next_receive = 0
        self.keys: set = set()  # region keys whose metadata was loaded
        self.last_heartbeat = 0.0
        self.lost: Optional[str] = None


class NixlTransport:
    """The object refit's engine drives (through its C++ adapter, python_transport.cpp) when
    ``backend_name`` is NIXL. Its methods never block: the adapter waits, with the GIL released
    between polls and with the engine's deadlines."""

    def __init__(self, config: "_refit.RefitConfig"):
        nixl = load_nixl()
        params = {str(k): str(v) for k, v in dict(config.backend_init_params).items()}
        self._plugin = params.pop("backend", "UCX")
        read_source_memory = params.get("read_source_memory", "false").lower()
        if read_source_memory not in ("true", "false"):
            raise _refit.ConfigError(
                f"refit_cfg.nixl.backend_init_params.read_source_memory: expected true or false, got "
                f"'{params['read_source_memory']}'")
        self._read_source_memory = read_source_memory == "true"
        for key in REFIT_PARAMS:
            params.pop(key, None)
        if self._plugin == "UCX" and str(config.device).startswith("cuda") and "engine_config" not in params:
            # UCX turns off CUDA IPC reads (get zcopy) where it sees no NVLink, which includes two
            # processes on one GPU: GPU memory is then read through shared memory at about 0.5 GiB/s
            # instead of about 1,600 GiB/s (H200, nixl-cu13 1.5.1). An engine_config replaces this.
            params["engine_config"] = "CUDA_IPC_ENABLE_GET_ZCOPY=y"
        self._name = f"refit-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            agent_config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
            self._agent = nixl.nixl_agent(self._name, agent_config)
        except Exception as e:
            raise _refit.TransportError(f"NIXL: creating the agent failed: {type(e).__name__}: {e}") from e
        plugins = list(self._agent.get_plugin_list())
        if self._plugin not in plugins:
            raise _refit.ConfigError(
                f"refit_cfg.nixl.backend_init_params.backend: NIXL has no plugin '{self._plugin}' here "
                f"(available: {', '.join(sorted(plugins))})")
        #: What went to NIXL's create_backend.
        self.backend_params = dict(params)
        try:
            self._agent.create_backend(self._plugin, params)
        except Exception as e:
            raise _refit.ConfigError(
                f"refit_cfg.nixl.backend_init_params: NIXL's {self._plugin} backend refused {params}: "
                f"{type(e).__name__}: {e}") from e
        self._memory_types = set(self._agent.get_backend_mem_types(self._plugin) or ())
        self._ids = itertools.count(1)
        self._regions: Dict[int, tuple] = {}  # id -> (memory type, device, registration)
        self._peers: Dict[int, _Peer] = {}
        self._inbox: Dict[str, Dict[int, bytes]] = {}  # agent name -> {number: message}
        self._reads: Dict[int, tuple] = {}  # id -> (NIXL transfer handles, peer)

    # ---- what the adapter asks ----

    def name(self) -> str:
        return "NIXL"

    def capabilities(self) -> Dict[str, bool]:
        # A READ reaches any registered memory of a peer: destinations may read sources' own tensors.
        return {"host_memory": True, "device_memory": any(m.startswith("VRAM") for m in self._memory_types),
                "remote_peers": True, "reads_registered_memory": self._read_source_memory}

    def route(self, peer: int) -> str:
        return f"NIXL {self._plugin}"

    # ---- memory ----

    def register(self, address: int, length: int, device: int) -> int:
        memory = 1 if device >= 0 else 0
        dev = max(device, 0)
        try:
            registration = self._agent.register_memory([(address, length, dev, "")], _MEMORY_TYPES[memory])
        except Exception as e:
            raise _refit.TransportError(
                f"NIXL: registering {length} bytes of {_MEMORY_TYPES[memory]} memory with the {self._plugin} backend "
                f"failed: {type(e).__name__}: {e}") from e
        region = next(self._ids)
        self._regions[region] = (memory, dev, registration)
        return region

    def describe(self, region: int) -> bytes:
        memory, dev, registration = self._regions[region]
        return _KEY.pack(memory, dev) + bytes(self._agent.get_partial_agent_metadata(registration, False))

    def deregister(self, region: int) -> None:
        entry = self._regions.pop(region, None)
        if entry is not None:
            self._agent.deregister_memory(entry[2])

    # ---- peers ----

    def address(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def connect(self, address: bytes, label: str) -> int:
        try:
            agent = self._agent.add_remote_agent(bytes(address))
        except Exception as e:
            raise _refit.ProtocolError(
                f"{label}: its NIXL agent metadata (inside its refit metadata) could not be loaded: "
                f"{type(e).__name__}: {e}") from e
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        try:
            self._agent.make_connection(agent)
        except Exception as e:
            raise self._lost_or_failed(e, f"{label}: connecting to its NIXL agent '{agent}' failed") from e
        peer = next(self._ids)
        self._peers[peer] = _Peer(agent, label)
        self._inbox.setdefault(agent, {})
        return peer

    def disconnect(self, peer: int) -> None:
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        for read, (_, owner) in list(self._reads.items()):
            if owner == peer:
                self.cancel_read(read)
        # The peer's agent stays loaded: NIXL loses large notifications on a connection made again
        # after invalidating the agent (NIXL 1.5), and the same peer is connected again after
        # release_after_refit. Messages numbered for this connection that were not taken go.
        self._inbox.pop(entry.agent, None)

    # ---- reads ----

    def post_read(self, peer: int, key: bytes, remote_address: int, local_address: int, local_region: int,
                  length: int) -> int:
        return self.post_reads(peer, [(key, remote_address, local_address, length)], local_region)

    def post_reads(self, peer: int, ranges, local_region: int) -> int:
        """Reads every (key, remote_address, local_address, length) of `ranges` from the peer into
        `local_region` as one read: one NIXL transfer per kind of remote memory, each a list of
        descriptors (a bucket's reads go in one call, not one per tensor)."""
        p = self._peer(peer)
        read = next(self._ids)
        groups: Dict[tuple, list] = {}  # (memory type, device) -> [(remote, local, length)]
        for key, remote_address, local_address, length in ranges:
            if length == 0:
                continue
            if len(key) < _KEY.size:
                raise _refit.ProtocolError(f"{p.label}: a NIXL region key of {len(key)} bytes is too short")
            remote_memory, remote_dev = _KEY.unpack_from(key)
            if remote_memory >= len(_MEMORY_TYPES):
                raise _refit.ProtocolError(f"{p.label}: a NIXL region key names memory type {remote_memory}")
            if key not in p.keys:
                try:
                    self._agent.add_remote_agent(bytes(key[_KEY.size:]))
                except Exception as e:
                    raise _refit.ProtocolError(
                        f"{p.label}: the NIXL metadata of its buffer could not be loaded: {type(e).__name__}: {e}") from e
                p.keys.add(key)
            groups.setdefault((remote_memory, remote_dev), []).append((remote_address, local_address, length))
        local_memory, local_dev, _ = self._regions[local_region]
        handles: List[Any] = []
        try:
            for (remote_memory, remote_dev), items in groups.items():
                length = sum(n for _, _, n in items)
                try:
                    local = self._agent.get_xfer_descs([(la, n, local_dev) for _, la, n in items],
                                                       _MEMORY_TYPES[local_memory])
                    remote = self._agent.get_xfer_descs([(ra, n, remote_dev) for ra, _, n in items],
                                                        _MEMORY_TYPES[remote_memory])
                    handle = self._agent.initialize_xfer("READ", local, remote, p.agent)
                except Exception as e:
                    raise self._lost_or_failed(e, f"NIXL READ of {length} bytes from {p.label} could not be created") from e
                handles.append(handle)
                try:
                    state = self._agent.transfer(handle)
                except Exception as e:
                    raise self._lost_or_failed(e, f"NIXL READ of {length} bytes from {p.label} failed to start") from e
                if state == "ERR":
                    raise self._lost_or_failed(None, f"NIXL READ of {length} bytes from {p.label} failed to start")
        except BaseException:
            for handle in handles:
                self._release(handle)
            raise
        self._reads[read] = (handles, peer)
        return read

    def test_read(self, read: int) -> bool:
        handles, peer = self._reads[read]
        pending, error, failed_state = [], None, None
        for handle in handles:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:  # noqa: BLE001
                error = error or e
                self._release(handle)
                continue
            if state == "PROC":
                pending.append(handle)
                continue
            self._release(handle)
            if state != "DONE":
                failed_state = failed_state or state
        if error is None and failed_state is None:
            if pending:
                self._reads[read] = (pending, peer)
                return False
            del self._reads[read]
            return True
        self._reads[read] = (pending, peer)
        self.cancel_read(read)
        if error is not None:
            raise self._lost_or_failed(error, f"NIXL READ from {self._label(peer)} failed") from error
        what = f"NIXL READ from {self._label(peer)} failed ({failed_state})"
        if self._gone(peer):
            raise _refit.PeerLostError(f"{what}: the peer went away (NIXL lost the connection)")
        raise _refit.TransportError(what)

    def cancel_read(self, read: int) -> None:
        entry = self._reads.pop(read, None)
        if entry is None:
            return
        handles, peer = entry
        for handle in handles:
            if self._release(handle):
                continue
            # NIXL would not abort the READ: closing the connection ends it, so that nothing more is
            # written into the local buffer once this returns.
            p = self._peers.get(peer)
            if p is not None:
                p.lost = "its READ was cancelled"
                try:
                    self._agent.remove_remote_agent(p.agent)
                except Exception:
                    pass
                self._release(handle)

    # ---- control messages ----

    def send(self, peer: int, message: bytes) -> None:
        p = self._peer(peer)
        try:
            self._agent.send_notif(p.agent, _HEADER.pack(_MESSAGE, p.next_send) + bytes(message))
        except Exception as e:
            raise self._lost_or_failed(e, f"sending a message to {p.label} over NIXL failed") from e
        p.next_send += 1

    def poll(self, peer: int) -> Optional[bytes]:
        p = self._peer(peer)
        self._collect()
        message = self._inbox.get(p.agent, {}).pop(p.next_receive, None)
        if message is not None:
            p.next_receive += 1
            return message
        now = time.monotonic()
        if now - p.last_heartbeat >= _HEARTBEAT_EVERY_S:
            p.last_heartbeat = now
            try:
                self._agent.send_notif(p.agent, _HEADER.pack(_HEARTBEAT, 0))
            except Exception as e:
                raise self._lost_or_failed(e, f"waiting for a message from {p.label}") from e
        return None

    # ---- helpers ----

    def _gone(self, peer: int) -> bool:
        """Whether the peer's connection is lost: NIXL refuses a notification to it once its
        endpoint has seen the failure, which takes a progress round or two."""
        p = self._peers.get(peer)
        if p is None:
            return False
        for _ in range(20):
            try:
                self._agent.send_notif(p.agent, _HEADER.pack(_HEARTBEAT, 0))
                self._agent.get_new_notifs()
            except Exception as e:
                return _disconnected(e)
            time.sleep(0.01)
        return False

    def _collect(self) -> None:
        try:
            notifications = self._agent.get_new_notifs()
        except Exception as e:
            raise _refit.TransportError(f"NIXL: reading notifications failed: {type(e).__name__}: {e}") from e
        for agent, messages in notifications.items():
            agent = agent.decode() if isinstance(agent, bytes) else str(agent)
            inbox = self._inbox.setdefault(agent, {})
            for raw in messages:
                raw = bytes(raw)
                if len(raw) < _HEADER.size:
                    continue  # not refit's (NIXL READ notifications are not used)
                kind, number = _HEADER.unpack_from(raw)
                if kind == _MESSAGE:
                    inbox[number] = raw[_HEADER.size:]

    def _peer(self, peer: int) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise _refit.InvalidArgumentError(f"NIXL: no connected peer {peer}")
        if p.lost:
            raise _refit.PeerLostError(f"{p.label}: its NIXL connection was closed ({p.lost})")
        return p

    def _label(self, peer: int) -> str:
        p = self._peers.get(peer)
        return p.label if p else f"peer {peer}"

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False

    @staticmethod
    def _lost_or_failed(error: Optional[BaseException], what: str) -> Exception:
        detail = f": {type(error).__name__}: {error}" if error is not None else ""
        if error is not None and _disconnected(error):
            return _refit.PeerLostError(f"{what}: the peer went away (NIXL lost the connection){detail}")
        return _refit.TransportError(f"{what}{detail}")
