"""refit as vLLM's own weight-transfer backend ``"refit"`` (vLLM 0.32's
``vllm.distributed.weight_transfer``), for engines driven through vLLM's RL interface: the offline
``LLM`` or ``vllm serve`` and its HTTP routes (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``).

    trainer = refit.vllm_transfer.TrainerEngine(rank=0, train_world_size=1, rollout_world_size=1,
                                                 bucket_bytes=256 << 20)
    llm = vllm.LLM(model=path, load_format="dummy", weight_transfer_config={"backend": "refit"})
    refit.vllm_transfer.connect(llm, trainer)                 # once (trainer: one rank, or a list)
    refit.vllm_transfer.update(llm, trainer, model.state_dict().items())   # every refit

Each vLLM worker runs a ``RefitWeightTransferEngine``: at init it makes refit's engine (its layout
read from the running engine, as ``refit.vllm_adapter.engine_layout``), and the trainer ranks'
engines and the workers' meet through a ``torch.distributed.TCPStore`` that trainer rank 0 hosts
(each publishes its metadata there and reads everyone's). A weight update is one refit into vLLM's
layerwise reload, loaded and checked exactly as ``refit.vllm_adapter`` does (``LiveReload``): the
tensors against the engine's table, a TP worker's slices through stand-ins that answer only vLLM's
own narrow, every layer with weights loaded, the reload finalized whatever happens. vLLM keeps the
prefix cache in its scheduler, out of a worker's reach: ``update`` resets it after each refit.
``connect`` and ``update`` drive an offline ``LLM`` or any of vLLM's weight-sync clients, e.g.
``HTTPVLLMWeightSyncClient`` for ``vllm serve`` (its RL routes need ``VLLM_SERVER_DEV_MODE=1``;
pause the server around each refit: ``POST /pause``, ``/resume``).

vLLM loads the backend by name in every worker process through the ``vllm.general_plugins`` entry
point of this package (``register``); importing this module registers it too.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

import refit
from refit.vllm_adapter import LiveReload, engine_layout, expected_weights
from refit.worker import weight_specs_of

BACKEND = "refit"


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """What every vLLM worker needs to join the trainer's engines (``TrainerEngine.init_info``)."""

    store_host: str
    store_port: int
    session: str  # hex of the group's refit.new_session_id()
    train_world_size: int
    rollout_world_size: int
    bucket_bytes: int
    rollout_rank_offset: int = 0  # this LLM's first rollout rank (data-parallel replicas)
    config: Dict[str, Any] = field(default_factory=dict)  # refit_cfg.nixl keys
    timeout_s: float = 300.0


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    partial: bool = False  # update only some weights (each vLLM layer whole)
    # (name, dtype, shape) of everything the trainer sends (refit.worker.weight_specs_of), checked
    # against the engine before anything loads; None: each tensor is checked as it arrives.
    specs: Optional[List[Any]] = None


def _exchange(host: str, port: int, session: str, role: str, rank: int, metadata: bytes, train: int, rollout: int,
              timeout_s: float, store: Any = None) -> List[bytes]:
    """Publishes this engine's metadata and returns every engine's, sources first (what
    init_*_process_group takes); a deadline, naming the ranks that never came."""
    from torch.distributed import TCPStore

    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    keys = [f"refit/{session}/train/{i}" for i in range(train)] + [f"refit/{session}/rollout/{j}" for j in range(rollout)]
    store.set(f"refit/{session}/{role}/{rank}", metadata)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - torch raises its own kinds for a timeout
        missing = [k.split("/", 2)[2] for k in keys if not store.check([k])]
        raise refit.RefitTimeoutError(f"{role} rank {rank}: {', '.join(missing) or 'no engine'} did not publish its "
                                      f"metadata at {host}:{port} within {timeout_s:.0f} s ({e})") from e
    return [bytes(store.get(k)) for k in keys]


class RefitWeightTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """The worker side: vLLM makes one per worker from ``weight_transfer_config={"backend": "refit"}``."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._engine: Optional[refit.CheckpointEngine] = None
        self._expected = None
        self._reload: Optional[LiveReload] = None
        self.rank: Optional[int] = None
        self.last_stats: Optional[dict] = None

    def _where(self) -> str:
        return f"vLLM destination rank {'?' if self.rank is None else self.rank}"

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        if self._engine is not None:
            raise refit.InvalidArgumentError(f"{self._where()}: init_weight_transfer_engine was called twice "
                                             f"(shutdown_weight_transfer_engine first)")
        parallel = self.parallel_config
        local = get_tensor_model_parallel_rank() + int(parallel.tensor_parallel_size) * get_pp_group().rank_in_group
        self.rank = int(init_info.rollout_rank_offset) + local
        self._expected = expected_weights(self.vllm_config, self.model)
        self._expected.layout = engine_layout(self.vllm_config, self.rank)
        kwargs = dict(init_info.config)
        kwargs.update(framework="torch", session=bytes.fromhex(init_info.session))
        if self._expected.layout is not None:
            kwargs["layout"] = self._expected.layout
        engine = refit.create_checkpoint_engine("nixl", int(init_info.bucket_bytes), kwargs)
        try:
            metadata = _exchange(init_info.store_host, init_info.store_port, init_info.session, "rollout", self.rank,
                                 engine.prepare(), init_info.train_world_size, init_info.rollout_world_size,
                                 init_info.timeout_s)
            engine.init_rollout_process_group(self.rank, init_info.train_world_size, init_info.rollout_world_size,
                                              metadata)
        except BaseException:
            engine.close()
            raise
        self._engine = engine

    def start_weight_update(self) -> None:
        if self._engine is None:
            raise refit.InvalidArgumentError(f"{self._where()}: init_weight_transfer_engine has not run")
        # No model runner reaches a weight-transfer engine: vLLM's LoRA, encoder and multimodal
        # caches are left as they are (VllmRolloutGroup drops them).
        self._reload = LiveReload(self.model, self.vllm_config, None, self._expected, self._where())
        self._reload.begin()

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """One refit. A failure finishes the reload here (vLLM calls no finish_weight_update then):
        the layers that got nothing keep their old weights, and the error says what failed."""
        reload = self._reload
        reload.partial = bool(update_info.partial)
        specs = update_info.specs
        checked = specs is None

        def load(batch: Any) -> None:
            nonlocal checked
            if not checked:  # before anything loads: raising here fails the refit on both sides
                checked = True
                self._expected.check_all([(n, d, tuple(s)) for n, d, s in specs], reload.partial, self._where())
            reload.load(batch)

        try:
            self.last_stats = self._engine.receive_weights(load)
        except BaseException:
            self._reload = None
            reload.end(False)
            raise

    def finish_weight_update(self) -> None:
        reload, self._reload = self._reload, None
        if reload is not None:
            reload.end(True)

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def register() -> None:
    """Registers the backend with vLLM (the ``vllm.general_plugins`` entry point; once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, RefitWeightTransferEngine)


register()


class TrainerEngine:
    """One trainer rank's side of the ``"refit"`` backend: a refit source engine. Rank 0 hosts the
    rendezvous store (``store_host``, port chosen when 0) unless ``store`` names one; every other
    rank gets ``store`` and ``session`` from rank 0 (``store_address``, ``session``)."""

    def __init__(self, rank: int, train_world_size: int, rollout_world_size: int, *, bucket_bytes: int,
                 config: Optional[Mapping[str, Any]] = None, store: Optional[Tuple[str, int]] = None,
                 session: Optional[str] = None, store_host: str = "127.0.0.1", timeout_s: float = 300.0,
                 **engine_kwargs: Any) -> None:
        from torch.distributed import TCPStore

        if rank != 0 and (store is None or session is None):
            raise refit.InvalidArgumentError(f"trainer rank {rank}: give it rank 0's store address and session")
        self.rank, self.train_world_size, self.rollout_world_size = rank, train_world_size, rollout_world_size
        self.bucket_bytes, self.config, self.timeout_s = int(bucket_bytes), dict(config or {}), float(timeout_s)
        self.session = session or refit.new_session_id().hex()
        self._store = None
        if store is None:
            self._store = TCPStore(store_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            store = (store_host, self._store.port)
        self.store_address = store
        kwargs = dict(self.config)
        kwargs.update(engine_kwargs)
        kwargs.update(framework="torch", session=bytes.fromhex(self.session))
        self.engine = refit.create_checkpoint_engine("nixl", self.bucket_bytes, kwargs)

    def init_info(self, rollout_rank_offset: int = 0) -> dict:
        """For ``llm.init_weight_transfer_engine({"init_info": ...})`` of the LLM whose first
        rollout rank is ``rollout_rank_offset``."""
        return {"store_host": self.store_address[0], "store_port": self.store_address[1], "session": self.session,
                "train_world_size": self.train_world_size, "rollout_world_size": self.rollout_world_size,
                "bucket_bytes": self.bucket_bytes, "rollout_rank_offset": rollout_rank_offset,
                "config": self.config, "timeout_s": self.timeout_s}

    def connect(self) -> None:
        """Meets the vLLM workers (while they run init_weight_transfer_engine)."""
        metadata = _exchange(*self.store_address, self.session, "train", self.rank, self.engine.prepare(),
                             self.train_world_size, self.rollout_world_size, self.timeout_s, self._store)
        self.engine.init_policy_process_group(self.rank, self.train_world_size, self.rollout_world_size, metadata)

    def send(self, weights: Iterable[Tuple[str, Any]], **kwargs: Any) -> Any:
        """This rank's part of one refit (while the workers run update_weights)."""
        return self.engine.send_weights(weights, **kwargs)

    def close(self) -> None:
        """Frees the engine, and on rank 0 the rendezvous store (its port)."""
        self.engine.close()
        self._store = None


def _together(calls: Sequence[Callable[[], Any]], timeout_s: float) -> List[Any]:
    """Runs each call on a thread of its own (vLLM's returns when its workers are done, each
    trainer rank's when it has sent) and returns their results; the first call's error first (vLLM's),
    the others' attached. The engines' own deadlines end every call; ``timeout_s`` is the net
    beneath them (RefitTimeoutError naming the calls still running)."""
    results: List[Any] = [None] * len(calls)
    errors: List[Optional[BaseException]] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"refit-vllm-transfer-{i}", daemon=True)
               for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    running = [i for i, t in enumerate(threads) if t.is_alive()]
    if running:
        raise refit.RefitTimeoutError(f"{'vLLM' if 0 in running else 'a trainer rank'} had not returned "
                                      f"{timeout_s:.0f} s later (calls {running} of {len(calls)})")
    failed = [e for e in errors if e is not None]
    if failed:
        for other in failed[1:]:
            failed[0].add_note(f"also failed: {type(other).__name__}: {other}")
        raise failed[0]
    return results


def _ranks(trainers: Union[TrainerEngine, Sequence[TrainerEngine]]) -> List[TrainerEngine]:
    return [trainers] if isinstance(trainers, TrainerEngine) else list(trainers)


def _net(ranks: Sequence[TrainerEngine]) -> float:
    """The deadline beneath a connect or an update: the rendezvous's and the engines' timeouts
    (refit_cfg.nixl.timeout_s, 300 s by default) one after the other, and a minute for vLLM's calls
    around them."""
    return max(t.timeout_s + float(t.config.get("timeout_s", 300)) for t in ranks) + 60


class _OfflineClient:
    """An offline ``vllm.LLM`` as vLLM's weight-sync client protocol (the LLM takes request dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def _client(vllm: Any) -> Any:
    """vLLM's weight-sync client for ``vllm``: an offline LLM, or a client as is (vLLM's
    ``HTTPVLLMWeightSyncClient`` for ``vllm serve``, ``RayVLLMWeightSyncClient``, or any object with
    init_weight_transfer_engine, start_weight_update, update_weights, finish_weight_update)."""
    return _OfflineClient(vllm) if hasattr(vllm, "llm_engine") else vllm


def _reset_prefix_cache(client: Any) -> None:
    """The prefix cache lives in vLLM's scheduler: an offline LLM resets it, a server at its
    /reset_prefix_cache route (there with the RL routes: VLLM_SERVER_DEV_MODE=1)."""
    if hasattr(client, "reset_prefix_cache"):
        client.reset_prefix_cache()
    elif hasattr(client, "base_url"):
        import requests

        requests.post(f"{client.base_url}/reset_prefix_cache", timeout=getattr(client, "timeout", 300)).raise_for_status()
    else:
        raise refit.InvalidArgumentError(f"{type(client).__name__} has no reset_prefix_cache() and no base_url: its "
                                         f"prefix cache would hold the old weights' keys and values after the refit")


def connect(vllm: Any, trainers: Union[TrainerEngine, Sequence[TrainerEngine]], rollout_rank_offset: int = 0) -> None:
    """Joins one vLLM's workers (an offline LLM or a weight-sync client, see ``_client``) and the
    trainer ranks of this process (``init_weight_transfer_engine``)."""
    ranks, client = _ranks(trainers), _client(vllm)
    _together([lambda: client.init_weight_transfer_engine(ranks[0].init_info(rollout_rank_offset))] +
              [t.connect for t in ranks], _net(ranks))


def update(vllm: Any, trainers: Union[TrainerEngine, Sequence[TrainerEngine]], weights: Iterable[Tuple[str, Any]], *,
           partial: bool = False, **send_kwargs: Any) -> List[Any]:
    """One refit of ``vllm`` (an offline LLM or a weight-sync client) from the trainer ranks of this
    process, each sending ``weights`` (a state dict's items; each engine sends what its destination
    keeps): start, update and finish the weight update through vLLM's interface while they send,
    then reset the prefix cache (its blocks hold the old weights' keys and values). Returns each
    rank's send stats. A server should be paused around it (POST /pause, /resume)."""
    ranks, client = _ranks(trainers), _client(vllm)
    specs = weight_specs_of(weights, f"trainer rank {ranks[0].rank}")
    info = {"partial": partial, "specs": None if specs is None else [[n, d, list(s)] for n, d, s in specs]}
    client.start_weight_update()
    try:
        stats = _together([lambda: client.update_weights(info)] +
                          [functools.partial(t.send, weights, **send_kwargs) for t in ranks], _net(ranks))[1:]
        client.finish_weight_update()
    finally:
        _reset_prefix_cache(client)
    return stats
