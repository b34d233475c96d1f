"""refit into a running vLLM: a worker extension for every vLLM worker, and a WorkerGroup that
drives one or more vLLM engines (data-parallel replicas) as the destinations of a refit.

    llm = vllm.LLM(model=path, load_format="dummy",        # the first refit brings the weights
                   worker_extension_cls="refit.vllm_adapter.RefitWorkerExtension")
    policy = refit.ProcessWorkerGroup(sources=1, destinations=0, program=make_program)
    group = refit.vllm_adapter.VllmRolloutGroup([llm], policy)
    sync = refit.WeightSynchronizer(config, group)
    sync.sync_weights()                                      # then llm.generate(...) uses them

How weights get into vLLM: through vLLM's in-place reload, the path its own weight-transfer
engines use. vLLM processes weights after loading (fuses q/k/v, repacks linear weights for its
CPU kernels, which empties the parameter), so the live model's ``load_weights`` alone is the
wrong call. Each refit runs ``initialize_layerwise_reload`` (layers go back to their checkpoint
shapes), hands every received batch to ``model.load_weights`` in checkpoint format, and
``finalize_layerwise_reload`` (layers whose tensors did not come get their old weights back).
vLLM keeps a layer's tensors until the layer is complete, and refit's views end with their
batch: the tensors vLLM still holds when a batch ends are cloned then (the rest load from refit's
views). After every refit, successful or not, the prefix cache is reset (cached blocks hold the
old weights' keys and values) and vLLM's own derived caches (LoRA, encoder, multimodal) are
dropped.

Tensor parallelism: each worker's layout is read from the running engine (``engine_layout``: its
TP rank's slices as vLLM cuts them), so its source sends only those bytes. vLLM's loaders cut a
rank's part from the whole checkpoint tensor with ``narrow``; the worker hands them a stand-in of
the whole tensor that answers exactly that narrow with the slice it received, refuses any other
(refit's layout and vLLM's partition disagree: an error naming both), and holds no bytes to read
any other way.

What is checked, so that nothing wrong loads silently: every vLLM worker builds the table of the
tensors its engine expects (checkpoint names and shapes, from the model's safetensors files or
its config.json, and the engine's dtype). Before a refit moves anything, the policy's tensor list
(``EngineWorker.weight_specs``) is checked against every table: an unknown name, another dtype or
shape, or a tensor of the table that no source sends (unless the refit is partial) is an error
naming the tensor, and vLLM keeps serving its old weights. During the refit, every received tensor is
checked against the table again before vLLM sees it, and a partial refit must bring every tensor
of each vLLM layer it touches (a fused layer half loaded would hold garbage). After it, what
arrived must cover the table (or, partial, be something), and every vLLM layer with weights must
have loaded some (vLLM's own count): a refit that left weights unchanged is an error, never a
success.

Errors keep their class: a worker's exception comes back as the same refit error class (or
RuntimeError naming the original class) with its message, and when the vLLM side fails, the
policy side's own error, if any, is attached, not lost. Ranks: replica d's worker of local rank r
is rollout rank ``d * world_size + r``; the group checks at init that the ranks are exactly
0..R-1 and says which collide.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import traceback
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import refit


#: (name, dtype, shape) of one tensor, dtype as refit names it ("bfloat16", "float32", ...).
WeightSpec = Tuple[str, str, Tuple[int, ...]]


# ---- what an engine expects -------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return refit.canonical_dtype(str(dtype))  # torch.bfloat16 -> bfloat16


class ExpectedWeights:
    """The tensors a vLLM engine takes in a refit, in checkpoint format: names, shapes and the
    dtype of its parameters, and how they group into vLLM layers (a fused q/k/v projection, a
    layer's experts), which a partial refit must bring whole."""

    def __init__(self, shapes: Mapping[str, Tuple[int, ...]], dtype: str, optional: Sequence[str] = (),
                 packed: Optional[Mapping[str, Sequence[str]]] = None, source: str = ""):
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.optional = set(optional)  # may be sent, need not be (a tied lm_head.weight)
        self.source = source
        self.layout: Optional[refit.Layout] = None  # this worker's share (engine_layout), None: all of it
        self._packed = {part: fused for fused, parts in (packed or {}).items() for part in parts}

    def group_of(self, name: str) -> str:
        """The vLLM layer a checkpoint tensor loads into: its module, with packed parts
        (q_proj, k_proj, v_proj -> qkv_proj) and experts (experts.7.w1 -> experts) folded."""
        parts = name.split(".")[:-1]
        if "experts" in parts:
            parts = parts[:parts.index("experts") + 1]
        elif parts and parts[-1] in self._packed:
            parts[-1] = self._packed[parts[-1]]
        return ".".join(parts)

    def check(self, name: str, dtype: str, shape: Tuple[int, ...], where: str) -> None:
        expected = self.shapes.get(name)
        if expected is None:
            raise refit.LayoutError(f"{where}: tensor '{name}' is not a weight of this vLLM model "
                                    f"({len(self.shapes)} known, from {self.source})")
        if dtype != self.dtype:
            raise refit.LayoutError(f"{where}: tensor '{name}' is {dtype} but the vLLM engine holds "
                                    f"{self.dtype}: refit sends bytes as they are and converts nothing")
        if tuple(shape) != tuple(expected):
            raise refit.LayoutError(f"{where}: tensor '{name}' has shape {list(shape)} but the vLLM model's "
                                    f"is {list(expected)} (from {self.source})")

    def kept(self, name: str) -> tuple:
        """What this worker's layout keeps of tensor ``name``: ('whole',), ('drop',) or
        ('narrow', dim, start, length)."""
        return ("whole",) if self.layout is None else tuple(self.layout.request_for(name))

    def not_sent(self, names: Iterable[str]) -> List[str]:
        """The weights of the table this worker keeps (but optional ones) that ``names`` leave out."""
        sent = set(names)
        return sorted(n for n in self.shapes
                      if n not in sent and n not in self.optional and self.kept(n)[0] != "drop")

    def receive(self, name: str, tensor: Any, where: str) -> Any:
        """A received tensor as vLLM's loaders take it, checked against the table: itself, or for
        a slice of this worker's layout, a stand-in of the whole tensor whose only readable part
        is that slice (``_slice_of_whole``)."""
        kept = self.kept(name)
        if kept[0] != "narrow":
            self.check(name, _dtype_name(tensor.dtype), tuple(tensor.shape), where)
            return tensor
        _, dim, start, length = kept
        whole = self.shapes.get(name)
        if whole is None:
            self.check(name, _dtype_name(tensor.dtype), tuple(tensor.shape), where)  # raises: not a weight here
        if dim >= len(whole):
            raise refit.LayoutError(f"{where}: this worker's layout keeps dim {dim} of '{name}', which has "
                                    f"{len(whole)} dims in the vLLM model ({self.source})")
        expected = tuple(whole[:dim]) + (length,) + tuple(whole[dim + 1:])
        if tuple(tensor.shape) != expected:
            raise refit.LayoutError(f"{where}: tensor '{name}' arrived with shape {list(tensor.shape)}, but this "
                                    f"worker keeps {list(expected)} of it (dim {dim}, [{start}, {start + length}))")
        self.check(name, _dtype_name(tensor.dtype), tuple(whole), where)
        return _slice_of_whole(name, tensor, tuple(whole), dim, start, length, where)

    def check_coverage(self, names: Sequence[str], partial: bool, where: str) -> List[str]:
        """A refit's tensor names against the table: all of it, or (partial) some tensors and
        every vLLM layer they touch whole. Returns the weights left out."""
        missing = self.not_sent(names)
        if missing and not partial:
            raise refit.LayoutError(
                f"{where}: {len(missing)} weight(s) of the vLLM model are not sent, e.g. '{missing[0]}' "
                f"(a refit that updates only some weights must say partial=True)")
        if not names:
            raise refit.LayoutError(f"{where}: the refit sends no weights: nothing in vLLM would change")
        touched = {self.group_of(n) for n in names}
        for name in missing:
            if self.group_of(name) in touched:
                raise refit.LayoutError(
                    f"{where}: a partial refit sends part of vLLM layer '{self.group_of(name)}' but not "
                    f"'{name}': vLLM loads a layer whole, so send all of its tensors or none")
        return missing

    def check_all(self, specs: Sequence[WeightSpec], partial: bool, where: str) -> None:
        """Checks a refit's whole tensor list before anything moves."""
        seen = set()
        for name, dtype, shape in specs:
            if name in seen:
                raise refit.LayoutError(f"{where}: tensor '{name}' is sent twice")
            seen.add(name)
            self.check(name, dtype, shape, where)
        self.check_coverage([n for n, _, _ in specs], partial, where)


def expected_weights(vllm_config: Any, model: Any) -> ExpectedWeights:
    """The table of a running vLLM engine: names and shapes from the safetensors files of the
    model's folder when it has them, else refit's model inventory of its config.json; the dtype
    is the engine's."""
    import glob
    import os

    model_config = vllm_config.model_config
    path = model_config.model
    dtype = _dtype_name(model_config.dtype)
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if files:
        inventories = [refit.load_model_inventory(f) for f in files]
        source = f"the safetensors files in {path}"
    else:
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise refit.ModelError(f"vLLM model '{path}': no safetensors files and no config.json to take the "
                                   f"expected weights from")
        inventories = [refit.load_model_inventory(config)]
        source = f"refit's inventory of {config}"
    shapes = {t.name: tuple(t.shape) for inventory in inventories for t in inventory.tensors}
    optional = []
    if tied:
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            shapes.setdefault("lm_head.weight", shapes[embed])
            optional.append("lm_head.weight")  # tied: vLLM skips it, a state_dict() has it
    packed = getattr(model, "packed_modules_mapping", None) or {}
    return ExpectedWeights(shapes, dtype, optional, packed, source)


def engine_layout(vllm_config: Any, destination_rank: int) -> Optional[refit.Layout]:
    """What this vLLM worker keeps, read from the running engine (None: the whole model): its
    tensor-parallel rank's slices of every tensor, as vLLM's loaders cut them (experts too; with
    expert parallelism the experts go whole and vLLM keeps its own). Its source then sends only
    those bytes. A pipeline stage gets every layer's slices and vLLM skips the layers it lacks."""
    import os
    import tempfile

    from vllm.distributed import get_tensor_model_parallel_rank

    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    if tp == 1:
        return None
    experts = not bool(getattr(parallel, "enable_expert_parallel", False))
    config = os.path.join(vllm_config.model_config.model, "config.json")
    with tempfile.TemporaryDirectory() as tmp:
        if not os.path.isfile(config):  # a hub name: the engine's own config
            config = os.path.join(tmp, "config.json")
            vllm_config.model_config.hf_config.to_json_file(config)
        return refit.destination_layout(config, tp_size=tp, tp_rank=get_tensor_model_parallel_rank(),
                                        shard_dense=True, shard_experts=experts, destination_rank=destination_rank)


def _slice_of_whole(name: str, piece: Any, shape: Tuple[int, ...], dim: int, start: int, length: int,
                    where: str) -> Any:
    """A stand-in for tensor ``name`` of ``shape`` of which this worker received only ``piece``,
    its slice [start, start + length) of ``dim``. vLLM's loaders take a tensor parallel rank's part
    of a checkpoint tensor with ``narrow``: this one answers that narrow with ``piece`` and refuses
    any other (a layout that disagrees with vLLM's partition is an error, not wrong weights). It is
    a meta tensor otherwise: anything that reads it another way fails instead of reading bytes that
    never came. The views vLLM's expert loader takes on the way (a leading dim added, then
    unbound) stay stand-ins."""
    return _slice_of_whole_class().make(piece, tuple(shape), dim, (name, start, length, where))


@functools.lru_cache(maxsize=None)
def _slice_of_whole_class() -> type:
    import torch

    class SliceOfWhole(torch.Tensor):
        _refit_piece: Any
        _refit_shape: Tuple[int, ...]
        _refit_dim: int
        _refit_kept: Tuple[str, int, int, str]  # name, start, length, where

        @classmethod
        def make(cls, piece: Any, shape: Tuple[int, ...], dim: int, kept: Tuple[str, int, int, str]) -> Any:
            stand_in = torch.Tensor._make_subclass(cls, torch.empty(shape, dtype=piece.dtype, device="meta"))
            stand_in._refit_piece, stand_in._refit_shape, stand_in._refit_dim = piece, shape, dim
            stand_in._refit_kept = kept
            return stand_in

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self = args[0] if args else None
            if isinstance(self, cls):
                if func in (torch.Tensor.narrow, torch.narrow):
                    return self._narrow(*args[1:], **kwargs)
                views = (torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.unbind, torch.unbind)
                dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) if func in views else None
                if func in views[:2] and dim == 0:
                    return cls.make(self._refit_piece.unsqueeze(0), (1,) + self._refit_shape, self._refit_dim + 1,
                                    self._refit_kept)
                if func in views[2:] and dim == 0 and self._refit_shape[0] == 1 and self._refit_dim > 0:
                    return (cls.make(self._refit_piece[0], self._refit_shape[1:], self._refit_dim - 1,
                                     self._refit_kept),)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)  # metadata, or a plain meta tensor: reading it fails

        def _narrow(self, *args: Any, **kwargs: Any) -> Any:
            name, start, length, where = self._refit_kept
            asked = dict(zip(("dim", "start", "length"), args), **kwargs)
            d, s, n = int(asked["dim"]) % len(self._refit_shape), int(asked["start"]), int(asked["length"])
            if (d, s, n) != (self._refit_dim, start, length):
                raise refit.LayoutError(
                    f"{where}: vLLM's loader takes dim {d} [{s}, {s + n}) of '{name}' but this worker's layout "
                    f"keeps dim {self._refit_dim} [{start}, {start + length}): refit's layout of this engine "
                    f"disagrees with vLLM's partition")
            return self._refit_piece

    return SliceOfWhole


# ---- errors that keep their class across collective_rpc -----------------------------------------


def _error_record(e: BaseException) -> dict:
    return {"refit_error": type(e).__name__, "module": type(e).__module__, "message": str(e),
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]}


def _raise_record(record: dict, where: str) -> None:
    cls = getattr(refit, record["refit_error"], None)
    if isinstance(cls, type) and issubclass(cls, refit.RefitError):
        error: BaseException = cls(f"{where}: {record['message']}")
    else:
        error = RuntimeError(f"{where}: {record['module']}.{record['refit_error']}: {record['message']}")
    error.add_note(f"in the vLLM worker:\n{record['traceback']}")
    raise error


def _returns_errors(method):
    """vLLM turns a worker's exception into a plain Exception (its class and often its message
    lost): the extension's methods return a record of the error instead, and the group raises it."""
    def wrapper(self, *args, **kwargs):
        try:
            return {"value": method(self, *args, **kwargs)}
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the driver
            return _error_record(e)
    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


# ---- the worker side ------------------------------------------------------------------------------


class RefitWorkerExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; VllmRolloutGroup calls its
    methods through ``llm.collective_rpc``. ``self`` is the vLLM worker."""

    _refit_engine: Optional[refit.CheckpointEngine] = None
    _refit_rank: Optional[int] = None
    _refit_expected: Optional[ExpectedWeights] = None

    def _refit_model(self) -> Any:
        return self.model_runner.get_model()

    @_returns_errors
    def refit_rollout_rank(self, replica: int) -> int:
        """This worker's rollout rank in replica ``replica``: replica * (TP x PP) + its rank."""
        return _rollout_rank(self, replica)

    @_returns_errors
    def refit_total_memory_bytes(self, device: str = "cpu") -> int:
        """Total memory of this worker's transfer device."""
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return refit.total_device_memory_bytes(device)

    @_returns_errors
    def refit_init_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any],
                          replica: int = 0) -> None:
        """Creates this worker's engine once (later calls keep it, as in the reference), with the
        layout of what this worker keeps (engine_layout): its source sends only that."""
        if self._refit_engine is None:
            kwargs = dict(engine_kwargs)
            kwargs["framework"] = "torch"
            expected = self._expected()
            expected.layout = engine_layout(self.vllm_config, _rollout_rank(self, replica))
            if expected.layout is not None:
                kwargs["layout"] = expected.layout
            self._refit_engine = refit.create_checkpoint_engine(backend, bucket_size_bytes, kwargs)

    @_returns_errors
    def refit_prepare(self) -> bytes:
        return self._engine().prepare()

    @_returns_errors
    def refit_init_process_group(self, replica: int, train_world_size: int, rollout_world_size: int,
                                 metadata: Sequence[bytes]) -> None:
        """Connects as rollout rank replica * (TP x PP) + this worker's rank (collective_rpc gives
        every worker the same arguments)."""
        self._refit_rank = _rollout_rank(self, replica)
        self._engine().init_rollout_process_group(self._refit_rank, train_world_size, rollout_world_size,
                                                  list(metadata))

    @_returns_errors
    def refit_check_weights(self, specs: Sequence[Sequence[WeightSpec]], partial: bool = False) -> None:
        """Checks what this worker's source (source rank = this rollout rank, paired) will send,
        ``specs[rank]``, against this engine before anything moves."""
        mine = specs[self._refit_rank] if self._refit_rank is not None and self._refit_rank < len(specs) else None
        if mine is None:
            raise refit.TopologyError(f"{self._label()}: no source rank {self._refit_rank} among {len(specs)}")
        self._expected().check_all([(n, d, tuple(s)) for n, d, s in mine], partial, self._label())

    @_returns_errors
    def refit_update_weights(self, partial: bool = False) -> dict:
        """One refit into the live model (see the module's docstring). Returns the receive stats,
        the names loaded and the weights of the table not sent; raises the refit's error, also
        when what arrived does not cover the model (or, ``partial``, whole layers of it)."""
        reload = LiveReload(self._refit_model(), self.vllm_config, self.model_runner, self._expected(),
                            self._label(), partial)
        reload.begin()
        ok = False
        try:
            stats = self._engine().receive_weights(reload.load)
            ok = True
        finally:
            not_sent = reload.end(ok)
        return {"stats": stats, "loaded": reload.loaded, "not_sent": not_sent}

    @_returns_errors
    def refit_finalize(self) -> None:
        if self._refit_engine is not None:
            self._refit_engine.finalize()

    @_returns_errors
    def refit_close(self) -> None:
        if self._refit_engine is not None:
            self._refit_engine.close()
            self._refit_engine = None

    def _engine(self) -> refit.CheckpointEngine:
        if self._refit_engine is None:
            raise refit.InvalidArgumentError(f"{self._label()}: refit_init_engine has not run")
        return self._refit_engine

    def _expected(self) -> ExpectedWeights:
        if self._refit_expected is None:
            self._refit_expected = expected_weights(self.vllm_config, self._refit_model())
        return self._refit_expected

    def _label(self) -> str:
        rank = "?" if self._refit_rank is None else self._refit_rank
        return f"vLLM destination rank {rank}"


class LiveReload:
    """One refit into a live vLLM model through vLLM's layerwise reload (see the module's
    docstring): ``begin()``, ``load(batch)`` for every batch refit receives, ``end(ok)``, which
    always gives the layers back (those that got nothing keep their old weights) and, when the
    receive went through, checks what arrived."""

    def __init__(self, model: Any, vllm_config: Any, runner: Any, expected: ExpectedWeights, where: str,
                 partial: bool = False):
        self.model, self.vllm_config, self.runner = model, vllm_config, runner
        self.expected, self.where, self.partial = expected, where, partial
        self.loaded: List[str] = []

    @contextlib.contextmanager
    def _in_vllm(self):
        import torch
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            yield

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with self._in_vllm():
            initialize_layerwise_reload(self.model)

    def load(self, batch: Iterable[Tuple[str, Any]]) -> None:
        def checked():
            for name, tensor in batch:
                tensor = self.expected.receive(name, tensor, self.where)
                self.loaded.append(name)
                yield name, tensor

        with self._in_vllm():
            self.model.load_weights(checked())
            _own_buffered_tensors()  # refit's views end with this batch

    def end(self, ok: bool) -> List[str]:
        """Finishes the reload; with ``ok`` (everything was received) checks it and returns the
        weights of the table not sent."""
        import torch
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        half: List[str] = []
        untouched: List[str] = []
        with self._in_vllm():
            try:
                if ok:
                    progress = [(n, m, get_layerwise_info(m)) for n, m in self.model.named_modules()
                                if not _is_deferred_attention(m)]
                    half = [f"{type(m).__name__} '{n}'" for n, m, info in progress
                            if 0 < (info.load_numel or 0) < (info.load_numel_total or 0)]
                    # Layers with weights of their own (not a rotary embedding's cache) that got none.
                    untouched = [f"{type(m).__name__} '{n}'" for n, m, info in progress
                                 if (info.load_numel_total or 0) > 0 and not info.load_numel
                                 and next(m.parameters(recurse=False), None) is not None]
            finally:
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)
                for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                    getattr(self.runner, reset, lambda: None)()
                # vLLM 0.32's reload copies new expert weights into a MoE layer but does not redo
                # its CPU kernel's prepacked copy of them, so the kernel goes on computing with the
                # old experts (vLLM's own reload_weights does too; measured on the CPU backend, the
                # only one where this runs). Prepacking from the layer's weights is what its first
                # load did.
                if _on_cpu():
                    for m in self.model.modules():
                        if _moe_kernel(m) is not None:
                            _moe_kernel(m).fused_experts.process_weights_after_loading(m)
        if not ok:
            return []
        # The table names the tensors; vLLM's own count of each layer is the net beneath it (a
        # layout that dropped a tensor the engine needs, a stream that left one out).
        not_sent = self.expected.check_coverage(self.loaded, self.partial, self.where)
        if half:
            raise refit.LayoutError(f"{self.where}: the refit loaded only part of {len(half)} vLLM layer(s), "
                                    f"e.g. {half[0]}: its other weights are now undefined; refit the whole model")
        if untouched and not self.partial:
            raise refit.LayoutError(f"{self.where}: the refit brought nothing for {len(untouched)} vLLM layer(s), "
                                    f"e.g. {untouched[0]}, which keep their old weights: a refit must bring every "
                                    f"layer (partial=True allows fewer)")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return not_sent


def _rollout_rank(worker: Any, replica: int) -> int:
    return int(replica) * int(worker.vllm_config.parallel_config.world_size) + int(worker.rank)


def _own_buffered_tensors() -> None:
    """vLLM's layerwise reload keeps the tensors of a layer it has not all of yet (as the loader's
    bound arguments) and loads them when the layer is complete, maybe batches later: those that
    are views of refit's buffers are cloned before the batch ends. Only those: a layer completed
    within the batch was loaded from the views directly (one copy fewer per byte). The layer's
    own parameters are on the meta device meanwhile, which tells them apart."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if not isinstance(value, torch.Tensor) or getattr(value, "_refit_owned", False):
                    continue
                if hasattr(value, "_refit_piece"):  # a slice's stand-in (_slice_of_whole): its piece
                    value._refit_piece = value._refit_piece.clone()
                    value._refit_owned = True
                elif value.device.type != "meta":
                    owned = value.clone()
                    owned._refit_owned = True
                    bound.arguments[key] = owned


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _moe_kernel(module: Any) -> Any:
    return getattr(getattr(module, "quant_method", None), "moe_kernel", None)


def _is_deferred_attention(module: Any) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return bool(is_deferred_attention_layer(module))


def register_weight_transfer() -> None:
    """vLLM's plugin hook (the ``vllm.general_plugins`` entry point, run in each vLLM process):
    refit as the weight-transfer backend ``"refit"`` (refit.vllm_transfer) where the installed
    vLLM has that interface (0.32 has it); nothing where it has not."""
    try:
        import vllm.distributed.weight_transfer  # noqa: F401
    except ImportError:
        return
    from refit.vllm_transfer import register

    register()


# ---- the driver side ------------------------------------------------------------------------------


class VllmRolloutGroup:
    """A refit.WorkerGroup: ``policy`` (a refit.BroadcastWorkerGroup of policy EngineWorkers, e.g.
    refit.ProcessWorkerGroup(sources=T, destinations=0, ...)) are the sources, the workers of the
    vLLM engines in ``llms`` (one per data-parallel replica) the destinations.

    ``partial=True`` lets refits update only some weights (each vLLM layer whole); the default
    refuses a refit that leaves any weight of the model out. Before each refit the policy's tensor
    list (EngineWorker.weight_specs) is checked on every vLLM worker; after it, each LLM's prefix
    cache is reset. ``last_not_sent`` holds, after a refit, the names each worker expects that
    the refit did not bring (a refit that brings none, or not all without ``partial``, fails)."""

    def __init__(self, llms: Any, policy: Any, *, partial: bool = False, join_timeout_s: float = 60.0):
        self.llms = list(llms) if isinstance(llms, (list, tuple)) else [llms]
        if not self.llms:
            raise refit.TopologyError("VllmRolloutGroup needs at least one vLLM engine")
        self.policy = policy
        self.partial = bool(partial)
        self.join_timeout_s = float(join_timeout_s)
        self.last_not_sent: List[List[str]] = []
        self._ranks: List[List[int]] = [self._rpc_one(llm, "refit_rollout_rank", d)
                                        for d, llm in enumerate(self.llms)]
        flat = [r for ranks in self._ranks for r in ranks]
        if flat != list(range(len(flat))):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise refit.TopologyError(
                f"vLLM workers take rollout ranks {self._ranks} (per replica): they must be 0..{len(flat) - 1} "
                f"once each, replica by replica" + (f"; rank(s) {dup} collide" if dup else ""))
        self.last_refit_seconds: Optional[float] = None

    @staticmethod
    def _rpc_one(llm: Any, method: str, *args: Any) -> List[Any]:
        records = list(llm.collective_rpc(method, args=args))
        for record in records:
            if "refit_error" in record:
                _raise_record(record, f"vLLM worker '{method}'")
        return [record["value"] for record in records]

    def _rpc(self, method: str, *args: Any, per_rank: Optional[Sequence[Sequence[Any]]] = None) -> List[Any]:
        """``method`` on every vLLM worker (replica by replica); ``per_rank``: argument tuples per
        replica, used instead of ``args`` (each worker of a replica gets its replica's)."""
        out: List[Any] = []
        for d, llm in enumerate(self.llms):
            out += self._rpc_one(llm, method, *(per_rank[d] if per_rank is not None else args))
        return out

    @property
    def train_world_size(self) -> int:
        return self.policy.train_world_size

    @property
    def rollout_world_size(self) -> int:
        return sum(len(r) for r in self._ranks)

    def total_memory_bytes(self, device: str) -> List[int]:
        return list(self.policy.call_all("total_memory_bytes", device)) + self._rpc("refit_total_memory_bytes",
                                                                                     device)

    def create_engines(self, backend: str, bucket_size_bytes: int, engine_kwargs: Mapping[str, Any]) -> None:
        self.policy.call_all("create_engine", backend, bucket_size_bytes, dict(engine_kwargs))
        self._rpc("refit_init_engine", per_rank=[(backend, bucket_size_bytes, dict(engine_kwargs), replica)
                                                 for replica in range(len(self.llms))])

    def prepare(self) -> List[bytes]:
        # Replica by replica, each in local-rank order: rollout rank order (checked at init).
        return list(self.policy.call_all("prepare")) + self._rpc("refit_prepare")

    def init_process_groups(self, metadata: Sequence[bytes]) -> None:
        t, r = self.train_world_size, self.rollout_world_size
        self.policy.call_all("init_process_group", t, r, list(metadata))
        for replica, llm in enumerate(self.llms):
            self._rpc_one(llm, "refit_init_process_group", replica, t, r, list(metadata))

    def refit(self, index: int) -> List[Any]:
        import time

        self.policy.call_all("stage", index)
        specs = self.policy.call_all("weight_specs", index)
        if specs and all(s is not None for s in specs):
            self._rpc("refit_check_weights", specs, self.partial)
        out: Dict[str, Any] = {}

        def send() -> None:
            try:
                out["policy"] = self.policy.call_all("refit", index)
            except BaseException as e:  # noqa: BLE001 - raised on the driver's thread below
                out["error"] = e

        start = time.perf_counter()
        thread = threading.Thread(target=send, name="refit-policy-send")
        thread.start()
        try:
            rollout = self._rpc("refit_update_weights", self.partial)
        except BaseException as e:
            thread.join(self.join_timeout_s)
            if "error" in out:
                e.add_note(f"the policy side failed too: {type(out['error']).__name__}: {out['error']}")
            elif thread.is_alive():
                e.add_note(f"the policy side had not returned {self.join_timeout_s:.0f} s later")
            raise
        finally:
            self.last_refit_seconds = time.perf_counter() - start
            for llm in self.llms:
                llm.reset_prefix_cache()  # cached blocks hold the old weights' keys and values
        thread.join(self.join_timeout_s)
        if thread.is_alive():
            raise refit.RefitTimeoutError(f"the vLLM side finished refit {index} but the policy side had not "
                                          f"returned {self.join_timeout_s:.0f} s later")
        if "error" in out:
            raise out["error"]
        self.last_not_sent = [r["not_sent"] for r in rollout]
        return list(out["policy"]) + rollout  # {"stats", "loaded", "not_sent"} per vLLM worker

    def finalize(self) -> None:
        self.policy.call_all("finalize")
        self._rpc("refit_finalize")

    def close(self) -> None:
        """Frees every vLLM worker's engine (the policy group is the caller's to close)."""
        self._rpc("refit_close")
