"""ORT sessions for verification and benchmarks: the one place they are built.

Options in code only (``session.load_model_format=ONNX``), models loaded from their path so external data
beside them resolves, the target's execution provider or a clear error when it is not installed, the
job's GPU memory limit on every CUDA session, onnxruntime-extensions' own library for prepost artifacts and
nothing else. ``optimize=False`` (verification) turns every ORT graph optimization off, so ORT's own fusions
cannot hide a bug; ``optimize=True`` (benchmarks) is what a user deploying the model gets.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import InvalidInputError, UnavailableError
from core.recipe import apply_recipe, sanitize_recipe
from workers.gpu import session_providers

_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def providers_for(target: str) -> list[str]:
    """The EP list for a target; raises UnavailableError when the target's EP is not installed."""
    import onnxruntime as ort

    wanted = _PROVIDERS.get(target)
    if wanted is None:
        raise InvalidInputError(f"unknown target {target!r}", code="INVALID_TARGET")
    available = set(ort.get_available_providers())
    if wanted[0] not in available:
        raise UnavailableError(
            f"target {target!r} needs {wanted[0]}, which this worker's onnxruntime does not provide "
            f"(available: {', '.join(sorted(available))}); route the job to a {target} worker",
            code="TARGET_UNAVAILABLE",
        )
    return [p for p in wanted if p in available]


ORT_CONSTANT_FOLD_MAX_BYTES = 256 << 20
# Op domains of onnxruntime-extensions (the prepost pass's tokenizer and image decoder ops).
EXTENSIONS_DOMAINS = (b"ai.onnx.contrib", b"com.microsoft.extensions")


def needs_extensions(model_path: Path) -> bool:
    """Whether the model file names an onnxruntime-extensions op domain (a prepost artifact).

    A byte scan, not a parse: the file is parsed once more by ORT anyway, and a false positive (the name in
    a doc string) only registers the one allow-listed library. Uploads using these domains never get here
    in the service: workers/validate.py refuses them before any parser runs."""
    try:
        st = os.stat(model_path)
    except OSError:  # ORT reports it
        return False
    return _scan_for_extensions(str(model_path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _scan_for_extensions(path: str, _mtime_ns: int, _size: int) -> bool:
    """Cached per file version: a job opens the same stage many times (verification, ledger, gate)."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(domain) >= 0 for domain in EXTENSIONS_DOMAINS)
    except (OSError, ValueError):  # unreadable or empty: ORT reports it
        return False


def register_extensions(options: Any) -> None:
    """Register onnxruntime-extensions' custom-op library from the installed package's own path: the only
    library a session may load (security.md bans custom-op libraries from uploads and requests)."""
    try:
        import onnxruntime_extensions
    except ImportError:
        return  # ORT then names the unregistered domain; the prepost pass itself needs the package
    options.register_custom_ops_library(onnxruntime_extensions.get_library_path())


def make_session(
    model_path: Path,
    *,
    target: str = "cpu",
    intra_op_threads: int = 0,
    optimize: bool = False,
    recipe: Mapping[str, Any] | None = None,
    save_optimized: Path | None = None,
    spinning: bool = True,
) -> Any:
    """An ORT session on ``model_path``. ``optimize=False``: ORT_DISABLE_ALL (verification);
    ``optimize=True``: ORT's default ORT_ENABLE_ALL, what a user deploying the model gets (benchmarks).
    ``recipe``: a ``tune_session`` recipe (metadata ``onnxforge.session``) applied on top, with its EP options,
    so that a benchmark measures the session users are told to create. ``save_optimized``: ORT writes the graph
    it will run there (``optimized_model_filepath``; workers/same_program.py compares two of them).
    ``spinning=False``: the thread pools block instead of spinning when idle (a recipe that sets it wins)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.load_model_format", "ONNX")
    # ORT's own constant folding can be forced to allocate huge tensors at session creation
    # (microsoft/onnxruntime#28730, security.md T7): cap what it may fold.
    options.add_session_config_entry(
        "optimization.constant_folding_max_output_size_in_bytes", str(ORT_CONSTANT_FOLD_MAX_BYTES)
    )
    if not spinning:
        set_by_recipe = set((recipe or {}).get("session_config") or {})
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning"):
            if key not in set_by_recipe:
                options.add_session_config_entry(key, "0")
    if needs_extensions(Path(model_path)):
        register_extensions(options)
    providers: list[Any] = list(providers_for(target))
    if recipe:
        # Apply what core.runtime.load would: its whitelist drops what users would not get.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recipe = {k: v for k, v in sanitize_recipe(dict(recipe)).items() if k != "warmup"}
        options, providers = apply_recipe(dict(recipe), options, target=target)
    if save_optimized is not None:
        options.optimized_model_filepath = str(save_optimized)
    providers = session_providers(providers, target)  # the job's GPU memory limit and device
    return ort.InferenceSession(str(model_path), sess_options=options, providers=providers)
