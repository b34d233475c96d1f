"""The checkpoint engine with the reference's API (NeMo RL's NIXL checkpoint engine).

One engine per worker process, on either side of a refit::

    engine = refit.create_checkpoint_engine("nixl", bucket_size_bytes, engine_kwargs)
    metadata = engine.prepare()                       # bytes: picklable, send it to the driver
    # the driver gathers every worker's metadata, sources (policy ranks) first
    engine.init_policy_process_group(worker_rank, T, R, all_metadata)     # a source
    engine.init_rollout_process_group(rollout_rank, T, R, all_metadata)   # a destination
    engine.send_weights((name, tensor) for ...)                           # a source, every refit
    for batch in engine.receive_weight_batches():                         # a destination
        model.load_weights(batch)                                         # list of (name, tensor)
    engine.finalize()

Lifetime of received tensors: a tensor that fitted one bucket is a zero-copy view into a
transfer buffer, valid until the next batch is requested (the next ``next()`` on the iterator,
or the end of the ``for`` body); copy what must live longer. A tensor split over several buckets
("merged") is owned by its Python object and stays valid as long as you keep it. Stopping the
iteration early (``break``, ``close()``, dropping the iterator) fails the refit: the destination
stays stale, the source gets an error.

Async code awaits the same calls (refit.base: they run on a worker thread; cancelling one fails
the refit)::

    stats = await engine.send_weights_async(weights)
    async with engine.receive_weight_batches_async() as batches:
        async for batch in batches:
            model.load_weights(batch)
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import Any, Iterable, Iterator, Mapping, Optional, Tuple, Union

from . import _refit
from ._refit import Layout, RefitConfig
from .base import CheckpointEngineBase

#: The keys of the reference's refit_cfg.nixl scope, plus refit's extensions, that configure an engine
#: (from the configuration table, refit.config_keys()).
CONFIG_KEYS = tuple(row["name"] for row in _refit.config_keys() if row["scope"] == "nixl")
#: engine_kwargs keys that are not configuration: the driver's session id, the model fingerprint,
#: the destination layout, the framework received tensors are handed out as, whether the engine
#: only receives (then it holds transfer buffers only when it cannot map its source's), and for
#: resharding a source's holdings and the model (a config.json path or a ModelInventory), and for
#: FP8 KV-cache scales the reference's vllm_cfg.kv_cache_dtype and the number of decoder layers.
ENGINE_KEYS = ("session", "model_fingerprint", "layout", "framework", "receives_only", "holds", "model",
               "kv_cache_dtype", "num_layers")

_FRAMEWORKS = ("auto", "numpy", "torch", "cupy", "dlpack")
_torch_available: Optional[bool] = None


def resolve_framework(framework: Optional[str]) -> str:
    """"auto" (or None): "torch" when PyTorch is installed, else "numpy"."""
    global _torch_available
    if framework is None or framework == "auto":
        if _torch_available is None:
            _torch_available = importlib.util.find_spec("torch") is not None
        return "torch" if _torch_available else "numpy"
    if framework not in _FRAMEWORKS:
        raise _refit.InvalidArgumentError(
            f"framework must be one of {', '.join(repr(f) for f in _FRAMEWORKS)}, got {framework!r}"
        )
    return framework


def as_config(config: Union[None, RefitConfig, Mapping[str, Any], str, os.PathLike] = None,
              overrides: Iterable[str] = ()) -> RefitConfig:
    """A RefitConfig from what a caller has at hand.

    - None: the defaults (plus ``overrides``);
    - a RefitConfig: itself (overrides applied on top);
    - a mapping: either a whole document (``{"refit_transport": ..., "refit_cfg": {"nixl": {...}}}``
      or a NeMo RL config with ``policy.generation``) or just the nixl scope's keys
      (``{"device": "cpu", "timeout_s": 60}``), as in the reference's engine_kwargs;
    - a path to a YAML file, or YAML text.
    Raises ConfigError with the C++ parser's message, naming the key.
    """
    overrides = list(overrides)
    if config is None:
        return _refit.parse_config("", overrides)
    if isinstance(config, RefitConfig):
        return _refit.parse_config(config.to_yaml(), overrides) if overrides else config
    if isinstance(config, Mapping):
        doc = dict(config)
        if not (_DOCUMENT_KEYS & doc.keys()):
            doc = {"refit_cfg": {"nixl": _scope(doc)}}
        # JSON is YAML: strings stay quoted (so "true" stays a string, as the reference's types say).
        return _refit.parse_config(json.dumps(doc, default=_json_default), overrides)
    if isinstance(config, (str, os.PathLike)):
        text = os.fspath(config)
        if "\n" not in text and (text.endswith((".yaml", ".yml")) or os.path.isfile(text)):
            return _refit.load_config(text, overrides)
        return _refit.parse_config(text, overrides)
    raise _refit.ConfigError(f"cannot make a refit configuration from a {type(config).__name__}")


#: The keys of a whole configuration document (refit layout or NeMo RL), not of the nixl scope alone.
_DOCUMENT_KEYS = frozenset({"refit_transport", "refit_cfg", "policy"})


def _scope(kwargs: Mapping[str, Any]) -> dict:
    scope = dict(kwargs)
    params = scope.get("backend_init_params")
    if isinstance(params, Mapping):
        # The reference passes every value through str() (8 -> "8").
        scope["backend_init_params"] = {str(k): (v if isinstance(v, str) else str(v)) for k, v in params.items()}
    return scope


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # NumPy scalars
        return value.item()
    raise TypeError(f"{type(value).__name__} is not a configuration value")


#: Bucket sizing is the driver's: it sends the size itself (bucket_size_bytes), not these keys.
_SIZING_KEYS = ("update_weights_bucket_memory_ratio", "bucket_bytes")


def engine_kwargs_from_config(config: RefitConfig) -> dict:
    """The reference's engine_kwargs scope (``{key: value}``) for ``config``: what a driver sends
    to its workers' ``create_checkpoint_engine(backend, bucket_size_bytes, engine_kwargs)``. Every
    configuration key but the sizing ones (CONFIG_KEYS), so that workers run what the driver was
    configured with."""
    out = {key: getattr(config, key) for key in CONFIG_KEYS if key not in _SIZING_KEYS}
    out["backend_init_params"] = dict(config.backend_init_params) or None
    return out


def _refuse_unknown_keys(kwargs: Mapping[str, Any]) -> None:
    """ConfigError naming the keys of an engine_kwargs scope that are neither configuration nor engine
    options, listing both (the C++ parser sees the configuration alone and would list only its keys).
    A whole document's keys are left to the parser."""
    unknown = [str(k) for k in kwargs if k not in CONFIG_KEYS and k not in ENGINE_KEYS]
    if unknown and not (_DOCUMENT_KEYS & kwargs.keys()):
        raise _refit.ConfigError(
            f"engine_kwargs: unknown key(s) {', '.join(unknown)}: expected configuration keys (refit_cfg.nixl: "
            f"{', '.join(CONFIG_KEYS)}) or engine options ({', '.join(ENGINE_KEYS)})")


def split_engine_kwargs(backend: str, engine_kwargs: Union[None, RefitConfig, Mapping[str, Any]]
                        ) -> Tuple[RefitConfig, dict]:
    """(configuration, engine options) from engine_kwargs in either shape the reference uses:
    the scope itself (``{"device": ...}``) or keyed by backend (``{"nixl": {"device": ...}}``).
    Engine options are the ENGINE_KEYS; everything else is configuration."""
    if engine_kwargs is None:
        return as_config(None), {}
    if isinstance(engine_kwargs, RefitConfig):
        return engine_kwargs, {}
    kwargs = dict(engine_kwargs)
    if backend in kwargs and isinstance(kwargs[backend], (Mapping, RefitConfig)):
        inner = kwargs.pop(backend)
        options = {k: kwargs.pop(k) for k in ENGINE_KEYS if k in kwargs}
        if kwargs:
            raise _refit.ConfigError(
                f"engine_kwargs: unknown key(s) {', '.join(sorted(kwargs))} next to '{backend}' "
                f"(expected only {', '.join(ENGINE_KEYS)})")
        if isinstance(inner, RefitConfig):
            return inner, options
        kwargs = dict(inner)
        _refuse_unknown_keys(kwargs)
        options.update({k: kwargs.pop(k) for k in ENGINE_KEYS if k in kwargs})
        return as_config(kwargs), options
    _refuse_unknown_keys(kwargs)
    options = {k: kwargs.pop(k) for k in ENGINE_KEYS if k in kwargs}
    return as_config(kwargs), options


class CheckpointEngine(CheckpointEngineBase):
    """refit's checkpoint engine (a source or a destination) with the reference's method names.
    The async forms (``send_weights_async``, ``receive_weight_batches_async``,
    ``receive_weights_async``) come from CheckpointEngineBase.

    Not thread-safe: one thread drives an engine (a receive iterator runs its transfer on a
    thread of its own, which it manages). The GIL is released during every transfer and wait.
    """

    def __init__(self, bucket_size_bytes: int, config: Union[None, RefitConfig, Mapping[str, Any], str] = None, *,
                 session: Optional[bytes] = None, model_fingerprint: int = 0, layout: Optional[Layout] = None,
                 framework: str = "auto", receives_only: bool = False, holds: Optional[Layout] = None,
                 model: Union[None, str, os.PathLike, "_refit.ModelInventory"] = None,
                 kv_cache_dtype: str = "auto", num_layers: Optional[int] = None):
        """``holds`` (a source) and ``model`` (every engine of a resharding group): see refit.reshard.

        ``kv_cache_dtype`` (the reference's vllm_cfg.kv_cache_dtype): a value starting with "fp8"
        makes every send_weights() append the FP8 KV-cache scales of each decoder layer (see
        send_weights); the layers are counted from ``model`` or given as ``num_layers`` (both: they
        must agree). Other values ("auto", the default) append nothing."""
        if not isinstance(kv_cache_dtype, str):
            raise _refit.ConfigError(f"kv_cache_dtype must be a str such as 'auto' or 'fp8', got {kv_cache_dtype!r}")
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)):
            raise _refit.ConfigError(f"num_layers must be an int, got {num_layers!r}")
        self._config = as_config(config)
        self._framework = framework
        resolve_framework(framework)  # validate early
        if isinstance(model, (str, os.PathLike)):
            model = _refit.load_model_inventory(os.fspath(model))
        transport = None
        if self._config.backend_name.upper() == "NIXL":
            from .nixl import NixlTransport  # NIXL is optional: imported only when asked for
            transport = NixlTransport(self._config)
        self._engine = _refit.CheckpointEngine(int(bucket_size_bytes), self._config, session,
                                               int(model_fingerprint), layout, bool(receives_only), holds, model,
                                               kv_cache_dtype, num_layers, transport)
        self.last_send_stats: Optional[dict] = None

    # ---- the reference's API ----

    def prepare(self) -> bytes:
        """Allocates and registers the two transfer buffers (if not already) and returns this
        engine's metadata: bytes, picklable, to be gathered by the driver."""
        return self._engine.prepare()

    def init_policy_process_group(self, worker_rank: int, train_world_size: int, rollout_world_size: int,
                                  metadata) -> None:
        """A source (policy rank ``worker_rank``): validates the pairing and everyone's metadata
        (sources first, then destinations), connects to destination ``worker_rank`` if it exists."""
        self._engine.init_source(worker_rank, train_world_size, rollout_world_size, list(metadata))

    def init_rollout_process_group(self, rollout_rank: int, train_world_size: int, rollout_world_size: int,
                                   metadata) -> None:
        """A destination (rollout rank ``rollout_rank``): connects to source ``rollout_rank``."""
        self._engine.init_destination(rollout_rank, train_world_size, rollout_world_size, list(metadata))

    def send_weights(self, weights: Iterable[Tuple[str, Any]],
                     kv_scales: Optional[Mapping[str, float]] = None, *, in_place: bool = False) -> dict:
        """One refit from a source: pulls (name, tensor) pairs on demand (an iterable of pairs, or a
        state dict such as ``model.state_dict()``) and returns when the destination has read the
        last bucket. Tensors: anything with ``__dlpack__`` or the buffer
        protocol (NumPy, PyTorch CPU/CUDA, CuPy); each is kept alive until the next one is pulled.
        Non-contiguous tensors are made contiguous (a copy). A source without a destination drains
        the iterator. Returns send statistics; raises the refit's error (its message names the
        peer and the phase).

        ``kv_scales`` (``{name: float}``, the reference's calibrated scales): with an fp8
        ``kv_cache_dtype`` the weights are followed, for every decoder layer i, by
        ``model.layers.{i}.self_attn.attn.q_scale``, ``...self_attn.k_scale`` and
        ``...self_attn.v_scale`` (float32, shape [1]), each the value in ``kv_scales`` or 1.0 when
        absent (also when ``kv_scales`` is None); other names in it are ignored, as the reference
        does. ConfigError when the engine knows no layer count (model=/num_layers=). With any
        other kv_cache_dtype, passing ``kv_scales`` (not None) raises InvalidArgumentError:
        nothing would send them.

        ``in_place=True`` promises that the tensors stay unchanged until this returns (the model's
        own parameters, not tensors made per item): refit then keeps every one alive until the end
        of the send instead of until the next pull, and a destination that maps this process's
        memory (CUDA IPC on one host, with direct_reads) loads straight from them, one copy per
        byte; the stats' ``in_place_bytes`` says how much went so. Tensors that cannot be mapped
        (host memory with UCX, strided views) still go through buckets.

        ``weights`` may be a ``refit.TensorSet`` (the model's parameters read once): every send
        then streams them from C++ with no Python call per tensor, as in place."""
        from .reshard import local_tensors  # DTensors go as their local shards
        if kv_scales is not None and isinstance(kv_scales, Mapping) and not isinstance(kv_scales, dict):
            kv_scales = dict(kv_scales)
        if not isinstance(weights, _refit.TensorSet):
            # Lazily: what is wrong with `weights` then surfaces inside the send, which tells the
            # destinations at once instead of leaving them to their deadline.
            weights = local_tensors(_pairs_of(weights))
        self.last_send_stats = self._engine.send(weights, kv_scales, bool(in_place))
        return self.last_send_stats

    @property
    def kv_scale_layers(self) -> Optional[int]:
        """The decoder layers whose KV-cache scales every send appends; None when it appends none
        (kv_cache_dtype not fp8, or no layer count known)."""
        return self._engine.kv_scale_layers

    def receive_weight_batches(self, framework: Optional[str] = None) -> "_refit.BatchIterator":
        """One refit at a destination: an iterator over batches (lists of (name, tensor)), one
        per bucket that completes a tensor. ``framework``: "torch", "numpy", "cupy", "dlpack" or
        "auto" (the engine's default: torch when installed). Zero-copy views are valid until the
        next batch is requested; a tensor merged from chunks keeps its own memory (the engine
        merges into fresh memory while it lives), without a copy. Stopping early fails the refit.
        After the loop, the iterator's ``stats`` has the receive statistics."""
        fw = resolve_framework(framework if framework is not None else self._framework)
        return self._engine.receive(fw)

    def get_target_weight_layout(self) -> Optional[Layout]:
        """On a source: the layout its destination declared (None: whole tensors, or no destination)."""
        return self._engine.target_layout()

    def finalize(self) -> None:
        """Disconnects, telling the peers: their next refit raises PeerLostError at once. With
        release_after_refit also frees the buffers. Cancels a receive that is still running. The
        next init needs a new prepare() and metadata exchange (one metadata, one connection)."""
        self._engine.finalize()

    # ---- refit's additions ----

    def request_full_refit(self) -> None:
        """Delta refit (``delta``): this destination asks for the whole model at its next refit,
        by declaring in its next prepare()'s metadata that it holds no version of the weights."""
        self._engine.request_full_refit()

    @property
    def stale(self) -> bool:
        """A destination is stale from the start of a receive until a refit completes."""
        return self._engine.stale

    @property
    def bucket_size(self) -> int:
        return self._engine.bucket_bytes

    @property
    def config(self) -> RefitConfig:
        return self._config

    @property
    def transport_name(self) -> str:
        return self._engine.transport_name()

    def receive_weights(self, load, framework: Optional[str] = None) -> dict:
        """One refit at a destination with a callback: ``load(batch)`` is called for every batch
        (a list of (name, tensor)); returns the receive statistics. The same lifetime rules as
        receive_weight_batches() (views are valid until ``load`` returns; merged tensors keep their
        memory), and the same loop on the calling thread. An exception raised by ``load`` fails the refit (both
        sides) and is the ``__cause__`` of the error raised here."""
        fw = resolve_framework(framework if framework is not None else self._framework)
        return self._engine.receive_into(load, fw)

    def close(self) -> None:
        """Frees the engine (buffers, transport) now, instead of at garbage collection. Views
        handed out earlier must not be used afterwards."""
        self._engine.close()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def create_checkpoint_engine(backend: str, bucket_size_bytes: int,
                             engine_kwargs: Union[None, RefitConfig, Mapping[str, Any]] = None,
                             **kwargs: Any) -> CheckpointEngineBase:
    """The reference's factory. ``backend``: "nixl" (refit's engine) or "module:ClassName" (a
    plugin class, called as ``cls(bucket_size=bucket_size_bytes, **engine_kwargs)``). A plugin
    class must derive from refit.CheckpointEngineBase; a backend that cannot be loaded raises
    ConfigError naming it (load_plugin_class). A plugin asked for ``shard_expert_weights=True``
    that does not override get_target_weight_layout() raises NotImplementedError naming the class.

    ``engine_kwargs``: the refit_cfg.nixl keys (device, backend_name, backend_init_params,
    release_after_refit, shard_expert_weights, timeout_s, verify_checksums), either directly or
    keyed by backend (``{"nixl": {...}}``), plus refit's engine options: ``session`` (bytes from
    refit.new_session_id(), the same for every engine of a group), ``model_fingerprint``,
    ``layout`` (a destination's refit.Layout), ``framework`` (default for received tensors) and
    ``receives_only`` (a destination that allocates transfer buffers only when it cannot map its
    source's; init_source() on it is an error), and for resharding ``holds`` (a source's holdings,
    refit.holdings_of) and ``model`` (refit.reshard), and for FP8 KV-cache scales
    ``kv_cache_dtype`` (default "auto"; "fp8...": sends append the scales) and ``num_layers``
    (the decoder layers, when ``model`` is not given).
    Extra keyword arguments are merged into engine_kwargs. Raises ConfigError naming a bad key.
    """
    if backend != "nixl":
        if ":" not in backend:
            raise _refit.ConfigError(
                f"Unknown checkpoint-engine backend '{backend}': expected 'nixl' or a 'module:ClassName' path")
        cls = load_plugin_class(backend)
        scope = dict(engine_kwargs or {})
        if backend in scope and isinstance(scope[backend], Mapping):
            scope = dict(scope[backend])
        scope.update(kwargs)
        if scope.get("shard_expert_weights") and \
                getattr(cls, "get_target_weight_layout", None) is CheckpointEngineBase.get_target_weight_layout:
            raise NotImplementedError(
                f"{cls.__name__} must override get_target_weight_layout() to run with shard_expert_weights=True "
                f"(backend '{backend}')")
        return cls(bucket_size=bucket_size_bytes, **scope)
    config, options = split_engine_kwargs(backend, engine_kwargs)
    # Keyword arguments: engine options, or configuration keys applied as overrides.
    _refuse_unknown_keys(kwargs)
    options.update({k: kwargs.pop(k) for k in ENGINE_KEYS if k in kwargs})
    if kwargs:
        config = as_config(config, [f"{k}={json.dumps(_scope({k: v})[k], default=_json_default)}"
                                    for k, v in kwargs.items()])
    return CheckpointEngine(bucket_size_bytes, config, **options)


def load_plugin_class(backend: str) -> type:
    """The class a ``module:ClassName`` backend names. ConfigError naming the backend when the
    module cannot be imported, has no such attribute, or the attribute is not a subclass of
    refit.CheckpointEngineBase. An error raised while the module runs (other than a failed import)
    propagates unchanged."""
    module_name, _, class_name = backend.partition(":")
    if not module_name or not class_name:
        raise _refit.ConfigError(
            f"checkpoint-engine backend '{backend}': expected 'module:ClassName' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise _refit.ConfigError(
            f"checkpoint-engine backend '{backend}': cannot import module '{module_name}': {e}") from e
    try:
        cls = getattr(module, class_name)
    except AttributeError as e:
        raise _refit.ConfigError(
            f"checkpoint-engine backend '{backend}': module '{module_name}' has no attribute '{class_name}'") from e
    if not isinstance(cls, type) or not issubclass(cls, CheckpointEngineBase):
        what = f"class {cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise _refit.ConfigError(
            f"checkpoint-engine backend '{backend}': '{class_name}' is {what}, which does not derive from "
            f"refit.CheckpointEngineBase; plugins must subclass it")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise _refit.ConfigError(
            f"checkpoint-engine backend '{backend}': {cls.__qualname__} does not implement "
            f"{', '.join(missing)} (abstract in refit.CheckpointEngineBase)")
    return cls


def _pairs_of(weights: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]) -> Iterator[Tuple[str, Any]]:
    yield from iter_weights(weights)


def iter_weights(weights: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs from a state dict or an iterable of pairs."""
    if isinstance(weights, Mapping):
        return iter(weights.items())
    return iter(weights)
