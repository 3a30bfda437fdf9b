"""Pack: a Hugging Face MoE checkpoint directory -> the packed format of ``loader.packed``.

Owns: mapping source keys onto the model's experts modules, fusing per-expert projections into
the module's own layout, encoding each expert once per precision, and writing the result
atomically. Invariants: the source is streamed one expert (or one dense tensor) at a time;
the output is built in a temporary directory beside the destination and renamed into place
only when complete, so an interrupted pack never leaves a directory that loads; from the first
write to the last, the pack holds its destination's lock (``loader.lock``), so packs of one
destination never overlap, and the final rename replaces only what it was given to replace
(``loader.swap``). Every exit, an error's included, removes what the pack created.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig

from .. import quant
from .blob import BLOB_ALIGN, align, blob_layout, scheme_options
from .calibrate import DEFAULT_LENGTH, DEFAULT_WINDOWS, LayerExperts, calibration_text, check_calibrated, record
from .destination import check_apart, remove_stale, staging_dir
from .layout import ExpertLayout, discover_layout, find_experts_modules, unservable
from .lock import hold
from .packed import MANIFEST, file_crc32, manifest_json, routing_prior
from .pack_summary import PackSummary
from .promote import NEXT, check_min_sqnr, promote
from .convert import NAMES, Converted, expert_slice, plan_outputs
from .skeleton import KeyMap, build_skeleton
from .source import SourceCheckpoint
from .source_formats import check_precisions
from .swap import claim, exists_error

DEFAULT_PRECISIONS = ("bf16", "int8")
DENSE_SHARD_BYTES = 1 << 30

# Per-expert projection names seen in checkpoints, by role.
_ROLE_ALIASES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
_PROJ_ROLE = {alias: role for role, names in _ROLE_ALIASES.items() for alias in names}
# Which roles make each fused experts-module tensor.
_TENSOR_ROLES = {
    "gate_up_proj": (("gate", "up"), "weight"),
    "gate_up_proj_bias": (("gate", "up"), "bias"),
    "up_proj": (("up",), "weight"),
    "up_proj_bias": (("up",), "bias"),
    "down_proj": (("down",), "weight"),
    "down_proj_bias": (("down",), "bias"),
}
_PER_EXPERT_RE = re.compile(r"^(?P<mod>.+)\.(?P<e>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class _Plan:
    """Where everything comes from: what ``_plan`` sorted the source's keys into."""

    experts: dict  # layer -> (module name, experts module)
    layouts: dict[int, ExpertLayout]
    dense: dict[str, str]  # model key -> source key
    sources: dict  # layer -> _ExpertSource
    skipped: list[str]
    converted: list[Converted]  # dense tensors transformers' weight converters make from groups of source keys
    keymap: KeyMap
    model: torch.nn.Module


@dataclass
class _ExpertSource:
    """Where one layer's experts come from in the source checkpoint."""

    fused: dict[str, str] = field(default_factory=dict)  # tensor name -> fused key [E, ...]
    parts: dict[tuple[int, str, str], str] = field(default_factory=dict)  # (expert, role, kind) -> key
    converted: dict[str, Converted] = field(default_factory=dict)  # tensor name -> converter group of fused keys
    runner: tuple = ()  # (KeyMap, model) the converter groups run with


def _fuse(layout: ExpertLayout, parts: dict[tuple[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert projections -> the experts module's own tensors for one expert."""
    out = {}
    for t in layout.tensors:
        roles, kind = _TENSOR_ROLES[t.name]
        pieces = [parts[(r, kind)] for r in roles]
        if len(pieces) == 1:
            fused = pieces[0]
        elif layout.is_concatenated:
            fused = torch.cat(pieces, dim=0)  # [2I, H] or [2I]
        else:
            fused = torch.stack(pieces, dim=1).reshape(-1, *pieces[0].shape[1:])  # [2I, H] rows interleaved
        if layout.is_transposed and fused.dim() == 2:
            fused = fused.t()
        out[t.name] = fused.contiguous()
    return out


def _plan(src: SourceCheckpoint, model: torch.nn.Module) -> _Plan:
    """Sort every source key into dense (model key), experts (layer -> source), converter groups or skipped."""
    experts = find_experts_modules(model)
    if not experts:
        raise ValueError(f"model type {model.config.model_type!r} has no experts module that transformers' experts registry drives")
    for _, module in experts.values():
        why = unservable(module)
        if why is not None:
            raise ValueError(f"{model.config.model_type} ({type(module).__name__}): {why}; Tiers cannot serve this family yet")
    layouts = {layer: discover_layout(mod) for layer, (_, mod) in experts.items()}
    keymap = KeyMap(model)
    dense_targets = set(model.state_dict().keys()) - {f"{name}.{t.name}" for layer, (name, _) in experts.items()
                                                      for t in layouts[layer].tensors}
    dense, sources, groups, skipped = _sort_keys(src, keymap, experts, layouts, dense_targets)
    converted = []
    for group in groups.values():
        mod, _, leaf = group.target.rpartition(".")
        layer = next((L for L, (name, _) in experts.items() if name == mod), None)
        if layer is not None and leaf in {t.name for t in layouts[layer].tensors}:
            patterns = [p for p, _ in group.sources]
            if len(set(patterns)) != len(patterns):  # one key per expert: only the projections pack knows are fused
                raise ValueError(f"{model.config.model_type}: experts tensor {group.target!r} is made from per-expert keys "
                                 f"{[k for _, k in group.sources][:3]}, whose projection names pack does not know")
            sources[layer].converted[leaf] = group
            sources[layer].runner = (keymap, model)
            continue
        plan_outputs(group, keymap, model, src)
        group.outputs = {k: v for k, v in group.outputs.items() if k in dense_targets and k not in dense}
        converted.append(group)
    made = {k for g in converted for k in g.outputs}
    missing_dense = sorted(dense_targets - dense.keys() - made - _tied_keys(model))
    if missing_dense:
        raise ValueError(f"source checkpoint lacks model weights {missing_dense[:8]} (of {len(missing_dense)} missing)")
    _check_experts(experts, layouts, sources)
    return _Plan(experts, layouts, dense, sources, skipped, converted, keymap, model)


def _sort_keys(src: SourceCheckpoint, keymap: KeyMap, experts, layouts, dense_targets: set[str]):
    """Each source key's place: (dense model key -> key, layer -> _ExpertSource, target -> converter group, skipped)."""
    by_module = {name: layer for layer, (name, _) in experts.items()}
    dense: dict[str, str] = {}
    sources = {layer: _ExpertSource() for layer in experts}
    groups: dict[str, Converted] = {}
    skipped: list[str] = []
    for key in src.keys():
        new, pattern = keymap.map(key)
        m = _PER_EXPERT_RE.match(keymap.renamed(key) if pattern else new)
        if m and m["mod"] in by_module and m["proj"] in _PROJ_ROLE:  # per-expert projections: pack fuses them itself
            sources[by_module[m["mod"]]].parts[(int(m["e"]), _PROJ_ROLE[m["proj"]], m["kind"])] = key
            continue
        mod, _, leaf = new.rpartition(".")
        expert_tensor = mod in by_module and leaf in {t.name for t in layouts[by_module[mod]].tensors}
        if pattern is not None and (new in dense_targets or expert_tensor):
            groups.setdefault(new, Converted(new)).sources.append((pattern, key))
        elif new in dense_targets:
            dense[new] = key
        elif expert_tensor:
            sources[by_module[mod]].fused[leaf] = key
        else:
            skipped.append(key)
    return dense, sources, groups, skipped


def _check_experts(experts, layouts, sources) -> None:
    """Every expert tensor of every layer has a source: a fused key, a converter group or every expert's projections."""
    for layer, s in sources.items():
        layout = layouts[layer]
        for t in layout.tensors:
            if t.name in s.fused or t.name in s.converted:
                continue
            roles, kind = _TENSOR_ROLES.get(t.name, ((), ""))
            if not roles:
                raise ValueError(f"layer {layer}: expert tensor {t.name!r} has no fused key in the checkpoint and no known per-expert form")
            for e in range(layout.num_experts):
                for r in roles:
                    if (e, r, kind) not in s.parts:
                        raise ValueError(
                            f"layer {layer} expert {e}: checkpoint has no {r} projection {kind} for {t.name!r} "
                            f"(looked for {experts[layer][0]}.{e}.{{{','.join(_ROLE_ALIASES[r])}}}.{kind})"
                        )


def _tied_keys(model: torch.nn.Module) -> set[str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", False):
        return set(tied.keys())
    if getattr(model.config, "tie_word_embeddings", False):
        return {"lm_head.weight"}
    return set()


def _read_expert(src: SourceCheckpoint, layout: ExpertLayout, s: _ExpertSource, e: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[tuple[str, str], torch.Tensor] = {}
    for t in layout.tensors:
        if t.name in s.fused:
            tensors[t.name] = src.get_expert(s.fused[t.name], e).contiguous()
        elif t.name in s.converted:
            group = s.converted[t.name]
            tensors[t.name] = expert_slice(group, *s.runner, src, group.target, e).contiguous()
        else:
            roles, kind = _TENSOR_ROLES[t.name]
            for r in roles:
                parts[(r, kind)] = src.get(s.parts[(e, r, kind)])
    if parts:
        fused = _fuse(layout, parts)
        tensors.update({k: v for k, v in fused.items() if k not in tensors})
    for t in layout.tensors:
        if tuple(tensors[t.name].shape) != t.shape:
            raise ValueError(f"expert {e}: {t.name!r} came out as {tuple(tensors[t.name].shape)}, the model expects {t.shape}")
    return tensors


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _safetensors_header(tensors: list[tuple[str, str, list[int]]], metadata: dict[str, str]) -> bytes:
    """A safetensors header for (name, dtype, shape) laid end to end, padded so data starts on 4 KiB."""
    hdr: dict = {"__metadata__": metadata}
    off = 0
    for name, dtype, shape in tensors:
        size = _ITEMSIZE[dtype] * math.prod(shape)
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    total = align(8 + len(raw), BLOB_ALIGN)
    raw += b" " * (total - 8 - len(raw))
    return len(raw).to_bytes(8, "little") + raw


def pack(
    src: str | Path,
    dst: str | Path,
    *,
    precisions: tuple[str, ...] | list[str] = DEFAULT_PRECISIONS,
    overwrite: bool = False,
    progress: bool = True,
    device: str | torch.device = "cpu",
    routing: str | Path | Mapping | None = None,
    options: Mapping[str, Mapping] | None = None,
    calibration: str | Path | None = None,
    calibration_windows: int = DEFAULT_WINDOWS,
    calibration_length: int = DEFAULT_LENGTH,
    min_sqnr: float | None = None,
) -> PackSummary:
    """Pack the checkpoint at ``src`` into ``dst``. Raises if ``dst`` exists unless ``overwrite``,
    and always (ValueError) if ``dst`` is ``src``, lies inside it or contains it.

    Races: a pack into a destination another pack is writing raises ``DestinationLocked`` (an
    OSError naming the destination and the other pack's pid) before writing anything. At the end,
    something that appeared at ``dst`` meanwhile (or, with ``overwrite``, replaced what was there
    at the start) is left untouched and the pack fails with FileExistsError; with ``overwrite``
    only what was at ``dst`` when the pack started is replaced. On any error nothing the pack
    created is left: no temporary directory, no lock file (parent directories it made remain).

    ``routing``: a routing file (``tiers.save_routing``) or its parsed document, embedded in the
    manifest as the checkpoint's routing prior, by which a load without a routing file ranks
    the experts for its hot and warm sets. It is checked against the source's MoE layers before
    anything is written.

    ``options``: a precision's encoder settings, ``{"int4": {"group": 32}}`` (the YAML's
    ``tiers.int4.group``; ``TiersConfig.pack_options``); the manifest records them per blob layout.

    ``calibration``: a text whose ``calibration_windows`` windows of ``calibration_length`` tokens calibrate int4
    (GPTQ: ``loader.calibrate``); refused before anything is written (read, where no int4 is packed).

    ``min_sqnr``: int4's and nf4's experts whose worst SQNR is below it are kept at int8 (``loader.promote``).

    ``device`` is where experts are quantized (one expert at a time); "cuda" speeds up large packs.
    bf16 blobs are the same bytes either way; INT8 blobs packed on a GPU have not been compared
    byte for byte with a CPU pack (the manifest's SQNR is computed on the device used).
    """
    t0 = time.perf_counter()
    src_path, dst = Path(src), Path(dst)
    precisions, options, dev = _check_arguments(precisions, options, calibration, min_sqnr, device)
    check_apart(src_path, dst)  # before the exists check, whose hint (--overwrite) would destroy the source here
    if os.path.lexists(dst) and not overwrite:  # early, before reading the source; claim checks again under the lock
        raise exists_error(dst)
    source = SourceCheckpoint(src_path)
    check_precisions(precisions, source)  # a precision the source's format cannot give (mxfp4 needs MXFP4)
    config = AutoConfig.from_pretrained(src_path)
    calib = calibration_text(calibration, precisions, src_path, config, windows=calibration_windows, length=calibration_length)
    model = build_skeleton(config)
    plan = _plan(source, model)
    prior = None
    if routing is not None:
        prior = routing_prior(routing, {L: layout.num_experts for L, layout in plan.layouts.items()}, str(src_path))

    if not dst.parent.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)  # exist_ok: another pack may make it in the meantime
    with hold(dst), claim(dst, overwrite=overwrite) as target:
        removed = remove_stale(dst)  # a pack killed outright (SIGKILL) left these, each as large as a pack
        tmp = staging_dir(dst, "tmp")
        if tmp.is_dir() and not tmp.is_symlink():  # this PID's under the lock: a dead pack's whose PID this one reuses
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            pack_doc = {"precisions": precisions, "source": src_path.name, **({} if min_sqnr is None else {"min_sqnr_db": min_sqnr})}
            dense_files, bytes_per_precision = _write(source, config, plan, tmp, (precisions, options, calib, min_sqnr), pack_doc,
                                                      prior, progress, dev, t0)
            target.place(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    n_experts = sum(layout.num_experts for layout in plan.layouts.values())
    dense_bytes = sum(f["nbytes"] for f in dense_files.values())
    return PackSummary(dst, n_experts, len(plan.layouts), bytes_per_precision, dense_bytes, time.perf_counter() - t0,
                       plan.skipped, routing_prior=prior is not None, removed=removed, calibration=pack_doc.get("calibration"),
                       min_sqnr=min_sqnr, promoted=pack_doc.get("promoted"))


def _check_arguments(precisions, options, calibration, min_sqnr, device) -> tuple[list[str], dict, torch.device]:
    """The arguments that need no source, checked before anything is read: (precisions, their
    encoder settings, the device)."""
    precisions = _check_precisions(precisions)
    check_calibrated(calibration, precisions)
    check_min_sqnr(min_sqnr, precisions)
    options = {p: dict(o) for p, o in (options or {}).items() if p in precisions}
    for p, o in options.items():
        scheme_options(p, o)  # a ValueError naming the precision and the setting, before anything is read
    return precisions, options, _check_device(device)


def _check_precisions(precisions) -> list[str]:
    if isinstance(precisions, str):
        raise TypeError(f"precisions {precisions!r}: pass a list of precision names, e.g. [{precisions!r}]")
    out = list(dict.fromkeys(precisions))
    if not out:
        raise ValueError("precisions is empty: pass at least one, e.g. ['bf16']")
    for p in out:
        quant.get_scheme(p)  # ValueError naming the unknown precision
    return out


def _check_device(device) -> torch.device:
    """The device experts are quantized on, checked usable before anything is written."""
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"device {str(device)!r} cannot quantize experts ({e}); pass cpu or an available cuda device") from None
    return dev


def _write(source, config, plan: _Plan, tmp: Path, encodings, pack_doc, prior, progress, dev, t0):
    """Every file of the pack into ``tmp``, the manifest last; (dense files, bytes per precision).
    ``encodings``: (the precisions, each one's encoder settings, the calibration text or None, min_sqnr)."""
    precisions, options, calib, min_sqnr = encodings
    carried = {}
    for f in source.carried_files():
        shutil.copy2(f, tmp / f.name)
        carried[f.name] = {"crc32": file_crc32(tmp / f.name), "nbytes": (tmp / f.name).stat().st_size}
    dense_files = _write_dense(source, plan, tmp)
    recorded = None
    if calib is not None:  # pass 1: the experts' inputs on the calibration text, for pass 2's Hessians
        layers = {L: LayerExperts(lay, lambda e, L=L: _read_expert(source, plan.layouts[L], plan.sources[L], e))
                  for L, lay in plan.layouts.items()}
        recorded = record(calib, config, _dense_units(source, plan), layers, tmp / ".calibration", dev)
    layer_docs, bytes_per_precision, expert_files, promoted = _write_experts(
        source, plan.experts, plan.layouts, plan.sources, (precisions, options, recorded, min_sqnr), tmp, progress, dev
    )
    if min_sqnr is not None:
        pack_doc["promoted"] = promoted
    if recorded is not None:
        shutil.rmtree(tmp / ".calibration")
        pack_doc["calibration"] = {**calib.doc(), "uncalibrated": recorded.uncalibrated}
    (tmp / MANIFEST).write_text(
        manifest_json(
            model_type=config.model_type,
            precisions=precisions,
            layers=layer_docs,
            dense_files=dense_files,
            carried=carried,
            expert_files=expert_files,
            pack={**pack_doc, "seconds": round(time.perf_counter() - t0, 3)},
            skipped_keys=plan.skipped,
            routing_prior=prior,
        )
    )
    return dense_files, bytes_per_precision


def _dense_units(source: SourceCheckpoint, plan: _Plan) -> list[tuple[list[tuple[str, str, list[int]]], Callable]]:
    """The dense tensors in write order, as units read together: (model key, dtype, shape) of each, and
    a function reading them (model key -> tensor). A plain key is a unit; a converter group is one."""
    units = []
    for model_key, src_key in sorted(plan.dense.items(), key=lambda kv: (source.key_to_file[kv[1]], kv[0])):
        dtype, shape = source.meta(src_key)
        units.append(([(model_key, dtype, shape)], lambda m=model_key, k=src_key: {m: source.get(k)}))
    for g in plan.converted:
        if g.outputs:
            units.append((sorted((k, d, sh) for k, (d, sh) in g.outputs.items()),
                          lambda g=g: g.run(plan.keymap, plan.model, source.get)))
    return units


def _write_dense(source: SourceCheckpoint, plan: _Plan, out: Path) -> dict[str, dict]:
    """Dense weights under the model's names, in shards of about 1 GiB, streamed one tensor (or one
    converter group) at a time."""
    shards: list[list] = [[]]
    size = 0
    for unit in _dense_units(source, plan):
        nbytes = sum(_ITEMSIZE[d] * math.prod(sh) for _, d, sh in unit[0])
        if shards[-1] and size + nbytes > DENSE_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += nbytes
    files: dict[str, dict] = {}
    for i, shard in enumerate(s for s in shards if s):
        name = f"dense-{i + 1:05d}.safetensors"
        header = _safetensors_header([t for entries, _ in shard for t in entries], {"format": "pt"})
        crc = zlib.crc32(header)
        with open(out / name, "wb") as f:
            f.write(header)
            for entries, read in shard:
                tensors = read()
                for model_key, dtype, shape in entries:
                    t = tensors[model_key]
                    if NAMES.get(t.dtype) != dtype or list(t.shape) != list(shape):
                        raise ValueError(f"dense tensor {model_key!r} came out as {t.dtype} {list(t.shape)}, planned {dtype} {shape}")
                    raw = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
                    f.write(raw)
                    crc = zlib.crc32(raw, crc)
        files[name] = {"crc32": crc, "nbytes": (out / name).stat().st_size}
    return files


def _write_experts(source, experts, layouts, sources, encodings, out: Path, progress: bool, device: torch.device):
    """Every layer's expert files; (layer entries, bytes per precision, expert files, experts kept at a
    higher precision per precision by ``min_sqnr``)."""
    precisions, options, recorded, min_sqnr = encodings
    promoted = {p: 0 for p in precisions if min_sqnr is not None and p in NEXT}
    total = sum(layouts[L].num_experts for L in layouts)
    bar = tqdm(total=total, desc="packing experts", unit="expert", disable=not progress)
    bytes_per_precision = dict.fromkeys(precisions, 0)
    layer_docs, expert_files = [], {}
    for layer, (module_name, module) in experts.items():
        layout = layouts[layer]
        inputs = recorded.layer(layer, module, layout) if recorded is not None else None
        blobs = {p: blob_layout(layout, p, options.get(p)) for p in precisions}
        handles, data_start, rel = {}, {}, {}
        for p in precisions:
            rel[p] = f"experts/{p}/layer-{layer:04d}.safetensors"
            (out / rel[p]).parent.mkdir(parents=True, exist_ok=True)
            header = _safetensors_header(
                [(f"expert.{e}", "U8", [blobs[p].stride]) for e in range(layout.num_experts)],
                {"format": "tiers-blob", "precision": p, "layer": str(layer)},
            )
            handles[p] = open(out / rel[p], "wb")
            handles[p].write(header)
            data_start[p] = len(header)
            expert_files[rel[p]] = {"header_crc32": zlib.crc32(header), "header_bytes": len(header),
                                    "nbytes": len(header) + layout.num_experts * blobs[p].stride}
        entries = []
        try:
            for e in range(layout.num_experts):
                tensors = {k: v.to(device) for k, v in _read_expert(source, layout, sources[layer], e).items()}
                entry: dict = {"expert": e}
                hessians = inputs.hessians(e, tensors) if inputs is not None else None  # GPTQ's, for int4
                for p in precisions:
                    blob, sqnr = blobs[p].encode(tensors, hessians)
                    raw = memoryview(blob.numpy())
                    handles[p].write(raw)
                    entry[p] = {
                        "file": rel[p],
                        "offset": data_start[p] + e * blobs[p].stride,
                        "nbytes": blobs[p].nbytes,
                        "crc32": zlib.crc32(raw[: blobs[p].nbytes]),
                        "sqnr_db": round(min(sqnr.values()), 3) if sqnr else None,
                    }
                    bytes_per_precision[p] += blobs[p].stride
                for p in promote(entry, min_sqnr) if min_sqnr is not None else ():
                    promoted[p] += 1
                entries.append(entry)
                bar.update(1)
        finally:
            for h in handles.values():
                h.close()
        layer_docs.append(
            {
                "layer": layer,
                "module": module_name,
                "layout": layout.to_json(),
                "blobs": {p: blobs[p].to_json() for p in precisions},
                "experts": entries,
            }
        )
    bar.close()
    return layer_docs, bytes_per_precision, expert_files, promoted
