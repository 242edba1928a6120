"""LoRA adapters for models that went through ``extract_adapters``: slots, ORT adapter files, peft conversion.

No FastAPI, no Celery: the pass, the pipeline and ``onnxforge adapters convert`` share this module.

A **slot** is one LoRA pair the pass moved out of the graph: two graph inputs ``A`` (``[in, rank]``) and
``B`` (``[rank, out]``) whose rank axis is symbolic and whose default is an empty initializer (rank 0, so
``x @ A @ B`` is zeros and the model computes its base). The extracted model lists its slots as JSON in the
model metadata under ``SLOTS_KEY``. An adapter (ONNX Runtime's ``.onnx_adapter`` format, written with
``onnxruntime.AdapterFormat``, loaded with ``onnxruntime.LoraAdapter`` and activated per run with
``RunOptions.add_active_adapter``) holds values for some or all of those inputs, with the LoRA scale folded
into ``B``; slots it does not cover keep their empty default (that module runs as the base).

``convert_peft`` turns a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
trained on the same base into such a file (what Olive's ``export-adapters`` does), and refuses, with an
``ADAPTER_*`` code, what the model has no slot for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import InvalidInputError

SLOTS_KEY = "lora.slots"  # not under "onnxforge.": the pipeline rewrites that namespace when it stamps
ADAPTER_SUFFIX = ".onnx_adapter"
ADAPTER_FORMAT_VERSION = 1  # written as the adapter's model version; bump if the slot layout changes
_WRAPPER_SCOPES = frozenset({"model", "base_model", "_orig_mod", "module"})
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)(?:\.(?P<name>[^.]+))?\.weight$")
# adapter_config.json keys whose non-default value means weights or behaviour the extracted slots cannot hold.
_UNSUPPORTED_CONFIG = {
    "use_dora": "DoRA (a magnitude vector per module)",
    "lora_bias": "LoRA bias vectors",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on raw parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
}


class AdapterError(InvalidInputError):
    """A peft adapter or extracted model that cannot be converted. Codes:

    ``ADAPTER_INVALID`` (unreadable directory, config or weights), ``ADAPTER_UNSUPPORTED`` (a peft feature the
    slots cannot express), ``ADAPTER_TARGET_MISSING`` (a target module with no slot), ``ADAPTER_BASE_MISMATCH``
    (a slot exists but its shapes differ: another base), ``ADAPTER_RANK_MISMATCH`` (lora_A/lora_B/config ranks
    disagree), ``NO_LORA_SLOTS`` (the model was not produced by extract_adapters).
    """

    code = "ADAPTER_INVALID"


@dataclasses.dataclass(frozen=True)
class Slot:
    module: str  # normalized module path, e.g. encoder.layer.0.attention.self.query; lora<i> when unknown
    module_known: bool
    a_input: str
    b_input: str
    in_features: int
    out_features: int
    rank: int  # the rank of the pair in the uploaded model (any rank fits the slot: the axis is symbolic)
    dtype: str  # numpy dtype name of A and B

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Slot:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


def normalize_module(path: str) -> str:
    """A module path without wrapper scopes: ``base_model.model.encoder.layer.0.x`` -> ``encoder.layer.0.x``.

    Leading ``model``/``base_model``/``module``/``_orig_mod`` components are dropped, the same way on the
    exported graph's hints and on peft's keys, so both sides meet whatever wrapped the model at export."""
    parts = [p for p in re.split(r"[./]", path) if p]
    while parts and parts[0] in _WRAPPER_SCOPES:
        parts.pop(0)
    return ".".join(parts)


def slots_json(slots: Iterable[Slot]) -> str:
    return json.dumps([s.to_dict() for s in slots], sort_keys=True, separators=(",", ":"))


def read_slots(model_path: Path) -> list[Slot]:
    """The slots an extracted model declares (reads the graph only, never external data)."""
    import onnx

    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:
        raise AdapterError(
            f"cannot read the model {model_path}: {type(exc).__name__}: {exc}", code="INVALID_MODEL"
        ) from exc
    raw = next((p.value for p in proto.metadata_props if p.key == SLOTS_KEY), None)
    if raw is None:
        raise AdapterError(
            f"{model_path.name} has no LoRA slots: it was not produced by the extract_adapters pass "
            "(optimize the peft export with --passes extract_adapters first)",
            code="NO_LORA_SLOTS",
        )
    try:
        slots = [Slot.from_dict(d) for d in json.loads(raw)]
    except (ValueError, KeyError, TypeError) as exc:
        raise AdapterError(
            f"{model_path.name}: metadata {SLOTS_KEY!r} is malformed: {exc}", code="NO_LORA_SLOTS"
        ) from exc
    if not slots:
        raise AdapterError(f"{model_path.name} declares no LoRA slot", code="NO_LORA_SLOTS")
    return slots


# ------------------------------------------------------------------------------------ adapter files


def adapter_bytes(params: Mapping[str, np.ndarray]) -> bytes:
    """``params`` in ONNX Runtime's adapter format, as bytes (AdapterFormat writes only to a path)."""
    with tempfile.TemporaryDirectory(prefix="onnxforge-adapter-") as tmp:
        path = Path(tmp) / f"a{ADAPTER_SUFFIX}"
        write_adapter(path, params)
        return path.read_bytes()


def write_adapter(path: Path, params: Mapping[str, np.ndarray]) -> None:
    """Write ``params`` (graph input name -> array) as an ``.onnx_adapter``; atomic (temp name, rename)."""
    import onnxruntime as ort

    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(ADAPTER_FORMAT_VERSION)
    # ortvalue_from_numpy does not copy: the arrays must outlive export_adapter, so keep them referenced.
    arrays = {k: np.ascontiguousarray(v) for k, v in params.items()}
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in arrays.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fmt.export_adapter(str(tmp))
    del arrays
    os.replace(tmp, path)


def read_adapter(path: Path) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    return {k: v.numpy() for k, v in ort.AdapterFormat.read_adapter(str(path)).get_parameters().items()}


def run_options(adapter_path: Path | None) -> tuple[Any, Any]:
    """``(RunOptions, LoraAdapter)`` with the adapter at ``adapter_path`` active, or ``(None, None)``.

    Keep the adapter referenced as long as the options are used: RunOptions does not own it."""
    if adapter_path is None:
        return None, None
    import onnxruntime as ort

    adapter = ort.LoraAdapter()
    adapter.Load(str(adapter_path))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    return options, adapter


# ---------------------------------------------------------------------------------- peft conversion


@dataclasses.dataclass
class _PeftPair:
    module: str  # as in the safetensors key, e.g. base_model.model.encoder.layer.0.attention.self.query
    a: np.ndarray | None = None  # lora_A.weight [r, in]
    b: np.ndarray | None = None  # lora_B.weight [out, r]


def _read_peft_dir(peft_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    config_path, weights_path = peft_dir / "adapter_config.json", peft_dir / "adapter_model.safetensors"
    if not peft_dir.is_dir():
        raise AdapterError(f"{peft_dir} is not a directory (expected a peft adapter directory)")
    if not config_path.is_file() or not weights_path.is_file():
        missing = [p.name for p in (config_path, weights_path) if not p.is_file()]
        extra = (
            " (adapter_model.bin is not read: pickles are unsafe; re-save with safetensors)"
            if (peft_dir / "adapter_model.bin").exists()
            else ""
        )
        raise AdapterError(f"{peft_dir} lacks {', '.join(missing)}{extra}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} does not hold a JSON object")
    try:
        from safetensors.numpy import load_file

        weights = load_file(str(weights_path))
    except Exception as exc:
        raise AdapterError(f"cannot read {weights_path}: {type(exc).__name__}: {exc}") from exc
    return config, weights


def _check_config(config: Mapping[str, Any]) -> None:
    peft_type = str(config.get("peft_type") or "LORA").upper()
    if peft_type != "LORA":
        raise AdapterError(
            f"peft_type {peft_type} is not LoRA; only LoRA adapters have slots", code="ADAPTER_UNSUPPORTED"
        )
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise AdapterError(
            f"bias={bias!r}: the adapter trains bias vectors of the base model, which the extracted model has "
            "no slot for (train with bias='none')",
            code="ADAPTER_UNSUPPORTED",
        )
    used = [what for key, what in _UNSUPPORTED_CONFIG.items() if config.get(key) not in (None, False, [], {}, "")]
    if used:
        raise AdapterError(
            f"the adapter uses {', '.join(used)}, which the extracted model has no slot for", code="ADAPTER_UNSUPPORTED"
        )


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """peft's rank_pattern/alpha_pattern lookup: the first key matching the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _match_slot(module: str, slots: Mapping[str, Slot]) -> Slot | None:
    norm = normalize_module(module)
    if norm in slots:
        return slots[norm]
    # Wrappers differ more than normalize_module knows: accept a unique match on whole trailing components.
    hits = [s for key, s in slots.items() if key.endswith("." + norm) or norm.endswith("." + key)]
    return hits[0] if len(hits) == 1 else None


def convert_peft(peft_dir: Path, model_path: Path, out_path: Path) -> dict[str, Any]:
    """Convert the peft adapter in ``peft_dir`` for the extracted model at ``model_path`` into
    ``out_path`` (``.onnx_adapter``). Returns a report: every pair converted and the slots left at base.
    Nothing is written unless every check passes."""
    slots = read_slots(model_path)
    config, weights = _read_peft_dir(peft_dir)
    _check_config(config)

    pairs: dict[str, _PeftPair] = {}
    foreign = []
    for key, array in weights.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            foreign.append(key)
            continue
        pair = pairs.setdefault(m["module"], _PeftPair(m["module"]))
        if m["which"] == "lora_A":
            pair.a = array
        else:
            pair.b = array
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (f" (+{len(foreign) - 5} more)" if len(foreign) > 5 else "")
        raise AdapterError(
            f"the adapter holds weights that are not LoRA A/B matrices ({shown}); the extracted model has no "
            "slot for them",
            code="ADAPTER_UNSUPPORTED",
        )
    if not pairs:
        raise AdapterError(f"{peft_dir / 'adapter_model.safetensors'} holds no LoRA weights")

    by_module = {s.module: s for s in slots if s.module_known}
    unmatched = [p.module for p in pairs.values() if _match_slot(p.module, by_module) is None]
    if unmatched:
        known = sorted(by_module)
        unknown = sum(1 for s in slots if not s.module_known)
        hint = f"; {unknown} slot(s) have no module path (the export kept no names to map them)" if unknown else ""
        raise AdapterError(
            f"the model has no slot for target module(s) {', '.join(sorted(normalize_module(m) for m in unmatched))} "
            f"(its slots: {', '.join(known) or 'none with a module path'}{hint}); was the adapter trained with "
            "other target_modules, or on another base?",
            code="ADAPTER_TARGET_MISSING",
            detail={"unmatched": sorted(unmatched), "slots": known},
        )

    r_default = int(config.get("r") or 8)
    alpha_default = float(config.get("lora_alpha") or r_default)
    rslora = bool(config.get("use_rslora"))
    params: dict[str, np.ndarray] = {}
    report_pairs: list[dict[str, Any]] = []
    covered: set[str] = set()
    for pair in sorted(pairs.values(), key=lambda p: p.module):
        slot = _match_slot(pair.module, by_module)
        assert slot is not None
        name = slot.module
        if slot.module in covered:
            raise AdapterError(f"two adapter modules map to the slot {name}", code="ADAPTER_TARGET_MISSING")
        covered.add(slot.module)
        if pair.a is None or pair.b is None:
            raise AdapterError(f"{pair.module}: lora_{'A' if pair.a is None else 'B'} is missing")
        if pair.a.ndim != 2 or pair.b.ndim != 2:
            raise AdapterError(
                f"{name}: lora_A {list(pair.a.shape)} and lora_B {list(pair.b.shape)} are not matrices "
                "(a LoRA on a convolution or embedding has no slot here)",
                code="ADAPTER_UNSUPPORTED",
            )
        rank = int(_pattern_value(config.get("rank_pattern") or {}, pair.module, r_default))
        alpha = float(_pattern_value(config.get("alpha_pattern") or {}, pair.module, alpha_default))
        (r_a, fan_in), (fan_out, r_b) = pair.a.shape, pair.b.shape
        if fan_in != slot.in_features or fan_out != slot.out_features:
            raise AdapterError(
                f"{name}: the adapter maps {fan_in} -> {fan_out} features, the model's layer maps "
                f"{slot.in_features} -> {slot.out_features}: the adapter was trained on another base model",
                code="ADAPTER_BASE_MISMATCH",
                detail={"module": name, "adapter": [fan_in, fan_out], "model": [slot.in_features, slot.out_features]},
            )
        if not (r_a == r_b == rank) or rank < 1:
            raise AdapterError(
                f"{name}: ranks disagree: lora_A has {r_a}, lora_B has {r_b}, the config says {rank}",
                code="ADAPTER_RANK_MISMATCH",
                detail={"module": name, "lora_A": r_a, "lora_B": r_b, "config": rank},
            )
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        dtype = np.dtype(slot.dtype)
        a = pair.a.astype(np.float64).T.astype(dtype)
        b = (pair.b.astype(np.float64).T * scale).astype(dtype)
        params[slot.a_input], params[slot.b_input] = a, b
        report_pairs.append(
            {
                "module": name,
                "rank": rank,
                "scale": scale,
                "a_shape": list(a.shape),
                "b_shape": list(b.shape),
                "bytes": int(a.nbytes + b.nbytes),
            }
        )
    write_adapter(out_path, params)
    return {
        "adapter": str(out_path),
        "pairs": report_pairs,
        "slots_at_base": sorted(s.module for s in slots if s.module not in covered),
        "bytes": out_path.stat().st_size,
    }
