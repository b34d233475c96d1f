"""The driver side of refit: a WeightSynchronizer runs the reference's lifecycle over any group of
workers that implements the small WorkerGroup protocol, so Ray actors, multiprocessing workers,
MPI ranks or anything else can drive refits.

    first sync_weights():  memory query -> bucket size (once), create engines (once),
                           prepare -> metadata -> init process groups        ("ready")
    every sync_weights():  one refit; a failed refit raises, and the next sync_weights()
                           creates engines again (a worker that has one keeps it: only a worker
                           put in place of a lost one gets a new engine, with the same session and
                           bucket size) and prepares again (workers whose refit failed replace
                           their engine); with release_after_refit, shutdown() afterwards (also
                           after a failure)
    shutdown():            finalize every worker; the next sync prepares again with fresh metadata

The lifecycle is the C++ refit::WeightSynchronizer's (include/refit/synchronizer.h), the one
driver of refit: this class binds it to a Python WorkerGroup (each call of the group runs with the
GIL, the driver without it; an exception the group raises comes out of sync_weights() as itself).
It follows NeMo RL's CheckpointEngineWeightSynchronizer.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from typing import Any, List, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from . import _refit
from ._refit import BucketSize, RefitConfig
from .engine import as_config, engine_kwargs_from_config


@runtime_checkable
class WorkerGroup(Protocol):
    """The workers as the driver sees them: ``train_world_size`` sources (policy ranks) and
    ``rollout_world_size`` destinations (rollout ranks). Each method acts on every worker and
    returns when all have answered; when any worker fails, the call raises (ideally the worker's
    own exception, naming it, with the other failures attached as notes).

    What a worker does for each call (refit.worker.EngineWorker implements it):

    - ``total_memory_bytes(device)``: ``refit.total_device_memory_bytes(device)`` of every worker,
      sources first;
    - ``create_engines(backend, bucket_size_bytes, engine_kwargs)``:
      ``refit.create_checkpoint_engine(backend, bucket_size_bytes, engine_kwargs)`` on every
      worker that has none (a worker that has an engine keeps it); called once, and again with
      the same arguments after a failed refit; engine_kwargs carries the session id;
    - ``prepare()``: every worker's ``engine.prepare()``, sources first then destinations, each by
      rank (metadata are bytes); a worker whose last refit failed replaces its engine first;
    - ``init_process_groups(metadata)``: sources ``init_policy_process_group(rank, T, R, metadata)``,
      destinations ``init_rollout_process_group(rank, T, R, metadata)``;
    - ``refit(index)``: one refit on every worker at once (sources ``send_weights``, destinations
      iterate ``receive_weight_batches``); returns one result per worker, sources first. A
      destination whose result is False failed (the reference's convention);
    - ``finalize()``: every worker's ``engine.finalize()``.

    Optional: ``last_refit_seconds``, the wall time of the last refit without what the group did
    before it (e.g. making synthetic weights); RefitReport.seconds uses it when present.
    """

    @property
    def train_world_size(self) -> int: ...

    @property
    def rollout_world_size(self) -> int: ...

    def total_memory_bytes(self, device: str) -> List[int]: ...

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None: ...

    def prepare(self) -> List[bytes]: ...

    def init_process_groups(self, metadata: Sequence[bytes]) -> None: ...

    def refit(self, index: int) -> List[Any]: ...

    def finalize(self) -> None: ...


@dataclasses.dataclass
class RefitReport:
    """What one refit did: its index, the driver's wall time, and each worker's result (sources
    first, then destinations, by rank)."""

    index: int
    seconds: float
    results: List[Any]
    train_world_size: int
    rollout_world_size: int

    @property
    def source_results(self) -> List[Any]:
        return self.results[: self.train_world_size]

    @property
    def destination_results(self) -> List[Any]:
        return self.results[self.train_world_size:]


class WeightSynchronizer:
    """Drives refits over a WorkerGroup.

    ``config``: a RefitConfig, a mapping of refit_cfg.nixl keys, a YAML path or text, or None
    (defaults). ``backend``: the checkpoint-engine backend the workers create; by default the
    configuration's refit_transport: "nixl" (refit's engine) or a "module:ClassName" plugin, which
    then gets its refit_cfg scope (release_after_refit and the plugin's own keys) as constructor
    arguments, as in the reference.
    ``model_bytes``: the most one source sends in a refit (the model's size, e.g.
    refit.load_model_inventory(path).total_bytes); no bucket is made larger (0: unknown).
    ``model_fingerprint``: passed to every engine (refit.load_model_inventory(path).fingerprint),
    so that workers with another model refuse each other's metadata; 0 disables the check.
    """

    def __init__(self, config: Union[None, RefitConfig, Mapping[str, Any], str], workers: WorkerGroup, *,
                 backend: Optional[str] = None, model_fingerprint: int = 0, model_bytes: int = 0):
        self.config: RefitConfig = as_config(config)
        self.workers = workers
        if backend is None:
            backend = self.config.refit_transport
        elif self.config.uses_plugin and backend != self.config.refit_transport:
            raise _refit.ConfigError(f"backend '{backend}' contradicts refit_transport "
                                     f"'{self.config.refit_transport}' of the configuration: give one of them")
        self.backend = backend
        self.model_fingerprint = int(model_fingerprint)
        this = weakref.ref(self)  # the driver must not keep this object alive (no cycle through C++)

        def engine_kwargs(session: bytes) -> dict:
            return this().engine_kwargs(session)

        self._driver = _refit.WeightSynchronizer(self.config, workers, backend, engine_kwargs, int(model_bytes))

    @property
    def stale(self) -> bool:
        """True until a refit succeeds, and again from the start of every refit until it succeeds."""
        return self._driver.stale

    @property
    def ready(self) -> bool:
        return self._driver.ready

    @property
    def bucket_size(self) -> BucketSize:
        """Resolved on first use from every worker's total memory, then fixed (as in the reference)."""
        return self._driver.bucket_size

    def engine_kwargs(self, session: bytes) -> dict:
        """The engine_kwargs every worker gets: the configuration scope keyed by backend (a plugin's:
        release_after_refit and its own keys), and the group's session id and model fingerprint."""
        if self.config.uses_plugin:
            scope = {"release_after_refit": self.config.release_after_refit,
                     **{k: json.loads(v) for k, v in self.config.plugin_params.items()}}
        else:
            scope = engine_kwargs_from_config(self.config)
        return {
            self.backend: scope,
            "session": session,
            "model_fingerprint": self.model_fingerprint,
        }

    def ensure_ready(self) -> None:
        """Creates engines (once, and again after a failed refit), prepares, exchanges metadata and
        connects (once per ready epoch). Raises TopologyError when the group's metadata do not
        number train_world_size + rollout_world_size.

        After a failed refit, create_engines() runs again with the same session and bucket size:
        workers that have an engine keep it (the WorkerGroup contract), and a worker the group put
        in place of a lost one (a new actor on a restarted host) gets its engine. The log line
        comes once."""
        self._driver.ensure_ready()

    def sync_weights(self) -> RefitReport:
        """One refit. Raises when any worker failed (the synchronizer then stays stale): the
        group's own exception, or RefitError("Weight transfer failed during <backend>
        checkpoint-engine sync: ...") when a destination's result is False. After a failure, and
        after every refit with release_after_refit, the workers are finalized (a failure of that
        is logged, never reported in place of the refit's own error). RefitReport.seconds is the
        group's ``last_refit_seconds`` when it has one, else the driver's wall time of refit()."""
        index, seconds, results, train, rollout = self._driver.sync_weights()
        return RefitReport(index, seconds, results, train, rollout)

    def shutdown(self) -> None:
        """Finalizes every worker (engines and bucket size are kept); the next sync prepares again."""
        self._driver.shutdown()
