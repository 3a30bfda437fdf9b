"""The public API: ``load`` a packed checkpoint as a transformers model served from the tiers, and read what they hold.

Owns building the model on meta from ``config.json``, loading the dense weights, making the
manager, binding each experts module to it and selecting the ``tiers`` experts implementation;
and ``stats``, ``manifest``, ``routing_counts``, ``save_routing`` over a loaded model.
Every check that can fail for a user's input runs here, before the first forward.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import safetensors
import safetensors.torch
import torch
import transformers
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tiers import hf, parallel, report
from tiers.config import TiersConfig, load_config
from tiers.graphs import step_graphs
from tiers.loader.layout import discover_layout, find_experts_modules, unservable
from tiers.loader.manifest_parse import FormatError
from tiers.loader.shown import show
from tiers.loader.pack_files import read_owned, verify_files
from tiers.loader.packed import MANIFEST, Manifest, read_manifest
from tiers.loader.routing import read_routing, routing_document, write_routing
from tiers.loader.skeleton import build_skeleton
from tiers.manager import Manager
from tiers.policy.placement import plan_placement
from tiers.stats import TierStats
from tiers.transfer.streams import Streams

_MANAGER_ATTR = "_tiers_manager"


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e}); expected 'cuda', 'cuda:N' or 'cpu'") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device: expected cuda or cpu, got {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {str(device)!r} asked for, but this torch sees no CUDA device "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); load with device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device: {str(device)!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def _load_dense(model: torch.nn.Module, manifest: Manifest, expert_params: set[str], device: torch.device) -> None:
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in expert_params}
    loaded: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for fname, info in manifest.dense_files.items():
        path = manifest.root / fname
        try:  # the bytes checked are the bytes used: the file is read once, whole, then parsed
            tensors = safetensors.torch.load(read_owned(manifest.root, fname, info, "dense weights file"))
        except safetensors.SafetensorError as e:
            raise FormatError(f"{path}: not a safetensors file ({show(str(e))})") from None
        for key, t in tensors.items():
            if key not in expected:
                raise FormatError(f"{path}: tensor {show(key)} is not a weight of this model")
            if key in owner:
                raise FormatError(f"{path}: tensor {show(key)} is also in {owner[key]!r}")
            owner[key] = fname
            ref = expected[key]
            if tuple(t.shape) != tuple(ref.shape):
                raise FormatError(f"{path}: {key!r} has shape {tuple(t.shape)}, the model expects {tuple(ref.shape)}")
            # a copy torch allocates (64-byte aligned) even on the CPU: a tensor parsed from the file's
            # bytes lies in memory torch did not allocate, at whatever alignment that has, and the CPU's
            # float32 matrix-vector kernels sum in an order that depends on the weight's alignment
            # (HY-V4's float32 lm_head: decode logits moved by 2.4e-7)
            loaded[key] = t.to(device=device, dtype=ref.dtype, copy=True)
    model.load_state_dict(loaded, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta" and n not in expert_params]
    if still_meta:
        raise ValueError(f"packed checkpoint {str(manifest.root)!r} lacks dense weights {still_meta[:8]}")
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _carried_json(manifest: Manifest, carried: dict[str, bytes], name: str) -> dict | None:
    """A carried JSON file's content from its checked bytes, or None if the pack carries no such file."""
    if name not in carried:
        return None
    path = manifest.root / name
    try:
        doc = json.loads(carried[name])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{path}: not valid JSON ({show(str(e))})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: expected a JSON object, got {show(doc)}")
    return doc


def _model_config(manifest: Manifest, carried: dict[str, bytes]) -> PretrainedConfig:
    """The model's config, built from the carried config.json's checked bytes (never re-read from disk)."""
    doc = _carried_json(manifest, carried, "config.json")
    if doc is None:
        raise FormatError(f"packed checkpoint {str(manifest.root)!r} carries no config.json; re-pack it from a save_pretrained directory")
    if doc.get("model_type") != manifest.model_type:
        raise FormatError(f"{manifest.root / 'config.json'}: model_type {show(doc.get('model_type'))}, "
                          f"the manifest says {manifest.model_type!r}")
    if manifest.model_type not in CONFIG_MAPPING:
        raise ValueError(f"{str(manifest.root)!r}: model family {manifest.model_type!r} is not known to transformers "
                         f"{transformers.__version__}")
    try:
        # transformers writes inf and nan as {"__float__": "Infinity"} (e.g. a Mamba time_step_limit); read them back as it does
        return CONFIG_MAPPING[manifest.model_type].from_dict(PretrainedConfig._decode_special_floats(doc))
    except Exception as e:  # noqa: BLE001 (transformers' checks raise many types: huggingface_hub's validation errors, TypeError, ...)
        raise FormatError(f"{manifest.root / 'config.json'}: not a {manifest.model_type} config ({type(e).__name__}: {show(str(e))})") from None


def _check_top_k(manifest: Manifest, config: PretrainedConfig) -> None:
    """A token routes to 1..E experts (E: the fewest a packed layer has); any other
    ``num_experts_per_tok`` fails only inside the forward, or routes to nothing."""
    k = getattr(config, "num_experts_per_tok", None)
    if k is None:  # a multimodal config keeps it in its text model's
        k = getattr(getattr(config, "text_config", None), "num_experts_per_tok", None)
    n = min(e.layout.num_experts for e in manifest.layers.values())
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n):
        raise FormatError(f"{manifest.root / 'config.json'}: num_experts_per_tok is {show(k)}, expected 1..{n} "
                          f"(the packed MoE layers have {n} experts)")


def _generation_config(manifest: Manifest, carried: dict[str, bytes]) -> GenerationConfig | None:
    """The carried generation_config.json's settings (None without one); values transformers refuses are refused naming the file."""
    doc = _carried_json(manifest, carried, "generation_config.json")
    if doc is None:
        return None
    try:
        return GenerationConfig.from_dict(doc)
    except Exception as e:  # noqa: BLE001 (its checks raise ValueError, TypeError, AttributeError, ...)
        raise FormatError(f"{manifest.root / 'generation_config.json'}: not a generation config "
                          f"({type(e).__name__}: {show(str(e))})") from None


def _skeleton(manifest: Manifest, config: PretrainedConfig) -> PreTrainedModel:
    """The model built on meta from ``config``; a config whose values no model can be built from
    (a negative size, zero heads) is refused naming config.json."""
    try:
        return build_skeleton(config, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001 (the model's constructor fails in its own ways on such values)
        raise FormatError(f"{manifest.root / 'config.json'}: no {manifest.model_type} model can be built from it "
                          f"({type(e).__name__}: {show(str(e))})") from None


def _experts(model: PreTrainedModel, manifest: Manifest) -> dict[int, tuple[str, torch.nn.Module]]:
    """The model's experts modules, checked against the manifest and against what Tiers can serve."""
    modules = find_experts_modules(model)
    config, where = manifest.root / "config.json", manifest.root / MANIFEST  # the two files that must agree
    if sorted(modules) != sorted(manifest.layers):
        raise FormatError(f"{config}: the model it builds has MoE layers {sorted(modules)}, {where} packed {sorted(manifest.layers)}; re-pack")
    for layer, (name, mod) in modules.items():
        why = unservable(mod)
        if why is not None:
            raise ValueError(f"{str(manifest.root)!r}: {model.config.model_type} ({type(mod).__name__}): {why}")
        entry = manifest.layers[layer]
        if discover_layout(mod) != entry.layout or name != entry.module:
            raise FormatError(f"{config}: layer {layer}'s experts ({name}) do not match the layout {where} packed "
                              f"for it ({entry.module}); re-pack")
    return modules


def _check_pack_options(cfg: TiersConfig, manifest: Manifest) -> None:
    """A config's pack settings (``tiers.int4.group``) are the pack's: a ValueError naming the key
    and both values when not (they shape the packed blobs; a load cannot change them)."""
    for precision, options in cfg.pack_options().items():
        for L, entry in manifest.layers.items():
            blob = entry.blobs.get(precision)
            packed = dict(blob.options) if blob is not None else None
            if packed is not None and any(packed.get(k) != v for k, v in options.items()):
                key, value = next((k, v) for k, v in options.items() if packed.get(k) != v)
                raise ValueError(f"tiers.{precision}.{key}: {value}, but {manifest.root} was packed with {precision} "
                                 f"{key} {packed.get(key, 'default')}; re-pack it with this config, or leave the key out")


def load(path: str | Path, config: str | Path | dict | TiersConfig | None = None, *, device: str | torch.device | None = None,
         verify: str = "first", progress: bool = True, streams: Streams | None = None, routing: str | Path | dict | None = None) -> PreTrainedModel:
    """Load a packed checkpoint as a transformers model whose experts are served from the tiers.

    ``config`` is a YAML path, a parsed dict, a ``TiersConfig`` or None (defaults: gpu 25%, cpu 50%
    as int8, the rest int8 on disk). ``device`` defaults to cuda when available. ``routing``: a
    routing file written by ``save_routing`` (or its parsed document); the hot and warm sets then
    start as the experts it counts most. Without one, the checkpoint's routing prior ranks them if
    it has one (``tools/pack.py --routing``), else round-robin over layers. ``progress``: the
    loading bar and one summary line per tier, on stderr.

    With ``tiers.parallel.experts`` in every rank of a torch.distributed group of more than one
    rank, each rank serves its block of every MoE layer's experts (``tiers.parallel``), its
    budgets its own, on ``cuda:LOCAL_RANK`` unless ``device`` says otherwise; a load that fails on
    one rank raises on every rank.
    """
    cfg = load_config(config)
    ranks = parallel.group_of(cfg.parallel.experts)
    if ranks is None:
        return _load(path, cfg, device, verify, progress, streams, routing, None)
    return parallel.agree(lambda: _load(path, cfg, device, verify, progress, streams, routing, ranks), *ranks,
                          signature=lambda model: manager_of(model).parallel.signature, close=lambda model: manager_of(model).close())


def _load(path, cfg: TiersConfig, device, verify: str, progress: bool, streams: Streams | None, routing,
          ranks: tuple[int, int] | None) -> PreTrainedModel:
    if ranks is not None:  # no CUDA graphs: a step would hold the exchanges, and a layer call's rows vary with the routing
        cfg = dataclasses.replace(cfg, gpu=dataclasses.replace(cfg.gpu, graphs=False))
        device = parallel.default_device() if device is None else device
    manifest = read_manifest(path)
    served = manifest if ranks is None else parallel.local_manifest(manifest, *ranks)  # the experts this process serves
    _check_pack_options(cfg, manifest)
    dev = _resolve_device(device)
    counts = read_routing(routing, manifest) if routing is not None else None
    if counts is not None and ranks is not None:
        counts = parallel.local_counts(counts, *ranks)
    placement = plan_placement(cfg, served, counts)
    carried = verify_files(manifest)
    config = _model_config(manifest, carried)
    _check_top_k(manifest, config)
    model = _skeleton(manifest, config)
    modules = _experts(model, manifest)
    expert_params = {f"{name}.{t.name}" for layer, (name, _) in modules.items() for t in manifest.layers[layer].layout.tensors}
    _load_dense(model, manifest, expert_params, dev)
    generation = _generation_config(manifest, carried)  # before the manager: a refusal leaves no reader threads or open files
    manager = Manager(served, cfg, placement, device=dev, streams=streams, verify=verify, progress=progress)
    if ranks is not None:
        manager.parallel = parallel.ExpertParallel(*ranks, manifest, dev)
    for layer, (_, mod) in modules.items():
        mod._tiers_binding = hf.Binding(layer, manager)
        mod.num_experts = served.layers[layer].layout.num_experts  # what the manager's call sees: this process's experts
    hf.register()
    model.set_experts_implementation(hf.IMPLEMENTATION)
    if cfg.gpu.graphs and dev.type == "cuda":
        step_graphs.install(model, manager)
    hf.follow_decode_switch(model, manager)
    if generation is not None:
        model.generation_config = generation
    setattr(model, _MANAGER_ATTR, manager)
    if progress:
        print("\n".join(f"tiers: {line}" for line in report.summary(manager)), file=sys.stderr)
    return model.eval()


def manager_of(model: torch.nn.Module) -> Manager:
    m = getattr(model, _MANAGER_ATTR, None)
    if m is None:
        raise ValueError("this model was not loaded with tiers.load")
    return m


def stats(model: torch.nn.Module, all_ranks: bool = False) -> TierStats:
    """Hits and misses per tier, bytes moved per source tier, copy and stall time, residency: this
    process's experts; with ``all_ranks`` (a collective: every rank must call it), summed over the
    ranks of an expert-parallel model."""
    manager = manager_of(model)
    local = report.stats(manager)
    return parallel.summed(local) if all_ranks and manager.parallel is not None else local


def manifest(model: torch.nn.Module) -> dict:
    """The runtime manifest: per expert its tier, slot, precision and bytes; per pool its slots'
    shape, stride, dtype, count and states; the host slab's layout; memory outside the budget.
    Plain data, JSON-serializable (``tools/inspect.py`` prints it)."""
    return report.manifest(manager_of(model))


def routing_counts(model: torch.nn.Module) -> dict:
    """The routing the rebalancer has counted (its window: the last ``window`` x ``every_tokens``
    tokens), as a routing document for ``save_routing`` or ``load(..., routing=)``. Routing is
    counted only with the rebalancer on (``tiers.rebalance.every_tokens`` > 0)."""
    manager = manager_of(model)
    if manager.rebalancer is None:
        raise ValueError("routing_counts: this model counts no routing; load it with tiers.rebalance.every_tokens > 0 "
                         "(and a gpu budget below every expert's bytes) to count it")
    manager.settle()  # whole-layer calls not yet counted count now
    counts, tokens = manager.rebalancer.routing_counts()
    return routing_document(counts, tokens)


def save_routing(model: torch.nn.Module, path: str | Path) -> Path:
    """Write the routing the model has counted (``routing_counts``) to ``path`` as JSON, so that a
    later ``load(..., routing=path)`` starts with the hot and warm sets it would have settled on.
    The file is replaced whole or not at all."""
    return write_routing(routing_counts(model), path)
