"""The session recipe: the ``onnxforge.session`` metadata entry that says how to open an artifact.

``tune_session`` and ``shape_profile`` write it; the pipeline benchmarks and reports the session it
describes; ``core.runtime.load`` opens users' sessions with it. This is its one home: the key, the
whitelist that makes an untrusted recipe safe to apply (only whitelisted names with type-checked values;
anything else is skipped with a ``RecipeWarning``), reading it from a file without parsing the weights,
and turning it into ``SessionOptions`` and providers.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx_ir as ir

RECIPE_KEY = "onnxforge.session"
RECIPE_KEYS = ("session_options", "session_config", "provider_options", "warmup")
MAX_RECIPE_CHARS = 64 << 10
MAX_WARMUP_CALLS = 4
MAX_WARMUP_ELEMENTS = 1 << 25  # per input: 32 M elements (256 MiB of int64) at most
_BOOL_STR = frozenset({"0", "1"})


class RecipeWarning(UserWarning):
    """A recipe entry was not applied (unknown, not allowed, or an invalid value)."""


# -------------------------------------------------------------------------------------- whitelists

_GRAPH_LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
_EXECUTION_MODES = ("ORT_SEQUENTIAL", "ORT_PARALLEL")

# SessionOptions attribute -> kind. Nothing that names a file, a library or a log/profile destination.
SESSION_OPTIONS: dict[str, Any] = {
    "enable_mem_pattern": bool,
    "enable_cpu_mem_arena": bool,
    "enable_mem_reuse": bool,
    "use_deterministic_compute": bool,
    "intra_op_num_threads": (0, 1024),
    "inter_op_num_threads": (0, 1024),
    "execution_mode": _EXECUTION_MODES,
    "graph_optimization_level": _GRAPH_LEVELS,
}
# Session config key -> allowed string values. Memory and threading knobs only.
SESSION_CONFIG: dict[str, frozenset[str]] = {
    "session.use_device_allocator_for_initializers": _BOOL_STR,
    "session.disable_prepacking": _BOOL_STR,
    "session.intra_op.allow_spinning": _BOOL_STR,
    "session.inter_op.allow_spinning": _BOOL_STR,
}
_STRATEGIES = frozenset({"kNextPowerOfTwo", "kSameAsRequested"})
# Provider -> option -> allowed values (a frozenset) or an (lo, hi) integer range.
PROVIDER_OPTIONS: dict[str, dict[str, Any]] = {
    "CPUExecutionProvider": {"arena_extend_strategy": _STRATEGIES},
    "CUDAExecutionProvider": {
        "arena_extend_strategy": _STRATEGIES,
        "gpu_mem_limit": (1 << 20, 1 << 50),
        "cudnn_conv_algo_search": frozenset({"EXHAUSTIVE", "HEURISTIC", "DEFAULT"}),
        "do_copy_in_default_stream": _BOOL_STR,
        "cudnn_conv_use_max_workspace": _BOOL_STR,
        # Written by the GPU benchmark only for models with static input shapes whose capture it checked;
        # such a session must be run with I/O binding (``BoundRun``): see the module docstring.
        "enable_cuda_graph": _BOOL_STR,
    },
}


def warn_recipe(message: str) -> None:
    warnings.warn(message, RecipeWarning, stacklevel=3)


def check_value(kind: Any, value: Any) -> Any:
    """The value to apply, or raise ValueError. ``kind``: bool, (lo, hi) ints, a tuple or set of strings."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expects true or false, got {value!r}")
    if isinstance(kind, tuple) and len(kind) == 2 and all(isinstance(k, int) for k in kind):
        number = int(value) if isinstance(value, str) and value.isdigit() else value
        if isinstance(number, int) and not isinstance(number, bool) and kind[0] <= number <= kind[1]:
            return number
        raise ValueError(f"expects an integer in {kind[0]}..{kind[1]}, got {value!r}")
    if isinstance(value, str) and value in kind:
        return value
    raise ValueError(f"expects one of {sorted(kind)}, got {value!r}")


# -------------------------------------------------------------------------------------- the recipe


def _whitelisted(
    entries: Any, allowed: Mapping[str, Any], what: str, check: Callable[[Any, Any], Any]
) -> dict[str, Any]:
    """The entries whose name ``allowed`` lists and whose value ``check(allowed[name], value)`` accepts; a
    RecipeWarning for each other one."""
    clean: dict[str, Any] = {}
    if not isinstance(entries, Mapping):
        return clean
    for name, value in entries.items():
        if name not in allowed:
            warn_recipe(f"{RECIPE_KEY}: {what} {name!r} is not allowed; ignored")
            continue
        try:
            clean[name] = check(allowed[name], value)
        except ValueError as exc:
            warn_recipe(f"{RECIPE_KEY}: {what} {name!r} {exc}; ignored")
    return clean


def _one_of(choices: Collection[str], value: Any) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"expects one of {sorted(choices)}")
    return value


def sanitize_recipe(recipe: Any) -> dict[str, Any]:
    """The applicable part of an untrusted recipe: whitelisted names, checked values; a RecipeWarning for
    each entry dropped. Warm-up shapes are checked for form here and against the model in ``load``."""
    clean: dict[str, Any] = {"session_options": {}, "session_config": {}, "provider_options": {}, "warmup": []}
    if not isinstance(recipe, Mapping):
        warn_recipe(f"{RECIPE_KEY} is not a JSON object; ignored")
        return clean
    for key in recipe:
        if key not in RECIPE_KEYS:
            warn_recipe(f"{RECIPE_KEY}: unknown key {key!r} ignored")
    options, config = recipe.get("session_options"), recipe.get("session_config")
    clean["session_options"] = _whitelisted(options, SESSION_OPTIONS, "session option", check_value)
    clean["session_config"] = _whitelisted(config, SESSION_CONFIG, "session config key", _one_of)
    providers = recipe.get("provider_options") or {}
    if isinstance(providers, Mapping):
        for provider, opts in providers.items():
            allowed = PROVIDER_OPTIONS.get(provider)
            if allowed is None or not isinstance(opts, Mapping):
                warn_recipe(f"{RECIPE_KEY}: options for provider {provider!r} are not allowed; ignored")
                continue
            checked = _whitelisted(opts, allowed, f"{provider} option", check_value)
            if checked:
                clean["provider_options"][provider] = {name: str(value) for name, value in checked.items()}
    warmup = recipe.get("warmup") or []
    if isinstance(warmup, list):
        for entry in warmup[:MAX_WARMUP_CALLS]:
            ok = isinstance(entry, Mapping) and all(
                isinstance(k, str)
                and isinstance(v, list)
                and len(v) <= 16
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 20 for d in v)
                for k, v in entry.items()
            )
            if ok:
                clean["warmup"].append({k: list(v) for k, v in entry.items()})
            else:
                warn_recipe(f"{RECIPE_KEY}: warm-up entry {str(entry)[:80]!r} is not {{input: [dims]}}; ignored")
        if len(warmup) > MAX_WARMUP_CALLS:
            warn_recipe(f"{RECIPE_KEY}: only the first {MAX_WARMUP_CALLS} warm-up calls are run")
    return clean


def _read_varint(f: Any) -> int | None:
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            return None
        b = byte[0]
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _parse_entry(data: bytes) -> tuple[str, str]:
    """A StringStringEntryProto (key = 1, value = 2)."""
    key = value = ""
    pos = 0

    def varint() -> int:
        nonlocal pos
        shift = result = 0
        while True:
            b = data[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while pos < len(data):
        tag = varint()
        field, wire = tag >> 3, tag & 7
        if wire == 2:
            n = varint()
            chunk = data[pos : pos + n].decode("utf-8", errors="replace")
            pos += n
            if field == 1:
                key = chunk
            elif field == 2:
                value = chunk
        elif wire == 0:
            varint()
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError("malformed metadata entry")
    return key, value


def read_metadata_props(path: str | os.PathLike[str], *, max_entry_bytes: int = 1 << 20) -> dict[str, str]:
    """``ModelProto.metadata_props`` (field 14) of an .onnx file, skipping the graph and its weights by seek:
    constant memory whatever the model's size. Entries above ``max_entry_bytes`` are skipped."""
    props: dict[str, str] = {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while True:
            tag = _read_varint(f)
            if tag is None:
                break
            field, wire = tag >> 3, tag & 7
            if wire == 0:
                if _read_varint(f) is None:
                    raise ValueError("truncated model file")
            elif wire == 1:
                f.seek(8, os.SEEK_CUR)
            elif wire == 5:
                f.seek(4, os.SEEK_CUR)
            elif wire == 2:
                length = _read_varint(f)
                if length is None or f.tell() + length > size:
                    raise ValueError("truncated model file")
                if field == 14 and length <= max_entry_bytes:
                    key, value = _parse_entry(f.read(length))
                    props[key] = value
                else:
                    f.seek(length, os.SEEK_CUR)
            else:
                raise ValueError(f"not an ONNX model (wire type {wire} at top level)")
    return props


def read_recipe(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The model's ``onnxforge.session`` recipe, sanitized; None when it has none (or it is not JSON)."""
    text = read_metadata_props(path).get(RECIPE_KEY)
    if text is None:
        return None
    if len(text) > MAX_RECIPE_CHARS:
        warn_recipe(f"{RECIPE_KEY} is larger than {MAX_RECIPE_CHARS} characters; ignored")
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        warn_recipe(f"{RECIPE_KEY} is not valid JSON; ignored")
        return None
    return sanitize_recipe(raw)


_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
_FALLBACK = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def default_recipe(target: str = "cpu") -> dict[str, Any]:
    return {
        "session_options": {
            "intra_op_num_threads": 0,
            "inter_op_num_threads": 1,
            "execution_mode": "ORT_SEQUENTIAL",
            "graph_optimization_level": "ORT_ENABLE_ALL",
        },
        "session_config": {},
        "provider_options": {} if target == "cpu" else {_PROVIDER[target]: {}},
    }


def recipe_of(model: ir.Model) -> dict[str, Any] | None:
    """The recipe an in-memory model carries, as written (unsanitized: the writer is our own pass)."""
    text = model.metadata_props.get(RECIPE_KEY)
    return json.loads(text) if text else None


def apply_recipe(recipe: dict[str, Any], options: Any = None, *, target: str = "cpu") -> tuple[Any, list[Any]]:
    """(SessionOptions, providers) from a recipe; ``options`` (a SessionOptions) is updated when given."""
    import onnxruntime as ort

    options = options or ort.SessionOptions()
    for key, raw in (recipe.get("session_options") or {}).items():
        value = raw
        if key == "execution_mode":
            value = ort.ExecutionMode.__members__[raw]
        elif key == "graph_optimization_level":
            value = ort.GraphOptimizationLevel.__members__[raw]
        elif not hasattr(options, key):
            raise ValueError(f"unknown session option {key!r} in the recipe")
        setattr(options, key, value)
    for key, value in (recipe.get("session_config") or {}).items():
        options.add_session_config_entry(str(key), str(value))
    available = set(ort.get_available_providers())
    provider_options = recipe.get("provider_options") or {}
    providers: list[Any] = []
    for name in [*provider_options, *_FALLBACK.get(target, [])]:
        if name in available and name not in [p[0] if isinstance(p, tuple) else p for p in providers]:
            opts = provider_options.get(name)
            providers.append((name, {k: str(v) for k, v in opts.items()}) if opts else name)
    return options, providers or ["CPUExecutionProvider"]
