"""The GPU side of a worker: which GPU a job's child uses, the CUDA EP options every session gets, and
whether a model may run as a CUDA graph.

One job per GPU. A worker on the ``gpu`` queue runs as many Celery pool processes as it sees GPUs
(``worker_concurrency``); each pool process keeps its index for its lifetime (billiard reuses the index of
a replaced process), and the child of every attempt it starts gets ``CUDA_VISIBLE_DEVICES`` pinned to
GPU ``index mod count``. Inside the child that GPU is therefore always device 0. The child is started by
``subprocess.Popen`` (fork immediately followed by exec of a fresh interpreter, workers/runner.py), and
nothing in the worker's own processes creates a CUDA context (GPU detection reads ``nvidia-smi`` or
/proc, never the driver API), so no process ever forks with CUDA initialised.

Per-job GPU memory limit. ``worker.gpu_mem_limit_mb`` reaches the child as the environment variable of
that setting (``ONNXFORGE_WORKER__GPU_MEM_LIMIT_MB``; the child's environment is otherwise minimal), and
``make_session`` passes it to CUDAExecutionProvider as ``gpu_mem_limit`` with
``arena_extend_strategy=kSameAsRequested`` in every session of the job (verify, benchmark, passes): the
default strategy grows the arena by powers of two, which reaches a limit long before the model needs it.
A recipe's own ``gpu_mem_limit`` can lower the limit, never raise it. TensorRT's engine workspace is not
part of the CUDA arena; only its fallback CUDA EP is capped.

CUDA graphs. ``enable_cuda_graph=1`` replays one captured launch sequence on fixed device addresses, so
it needs inputs bound once with I/O binding, one shape per input (``cuda_graph_eligibility``: every graph
input dim declared static) and every node on the CUDA EP. ORT is the judge of the last condition: the
benchmark tries (session creation, capture on the first bound runs, outputs against a run without the
graph) and falls back with the reason (workers/benchmark.py).

No onnxruntime import at module level: the worker parent imports this module to size its pool.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

GPU_TARGETS = frozenset({"cuda", "tensorrt"})
MEM_LIMIT_ENV = "ONNXFORGE_WORKER__GPU_MEM_LIMIT_MB"
CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"


def is_gpu_target(target: str) -> bool:
    return target in GPU_TARGETS


def device_for(target: str) -> tuple[str, int]:
    """(ORT device name, device id) that inputs and outputs of a ``target`` session live on.

    Device 0: the runner pins ``CUDA_VISIBLE_DEVICES`` to the job's one GPU."""
    return ("cuda", 0) if is_gpu_target(target) else ("cpu", 0)


# ------------------------------------------------------------------------------------ one job per GPU


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` when set (empty or -1: none), else one id
    per GPU that ``nvidia-smi`` or the driver's /proc entries list."""
    environ = os.environ if environ is None else environ
    pinned = environ.get("CUDA_VISIBLE_DEVICES")
    if pinned is not None:
        ids = [p.strip() for p in pinned.split(",") if p.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way of hiding every GPU.
        out = []
        for gpu in ids:
            if gpu.startswith("-"):
                break
            out.append(gpu)
        return out
    from core.hardware import _gpus  # nvidia-smi or /proc: no CUDA context in the worker parent

    return [str(i) for i in range(len(_gpus()))]


def gpu_concurrency(requested: int | None, queues: Sequence[str], gpus: Sequence[str]) -> int | None:
    """Pool size for a worker consuming ``queues``: one job per GPU on the ``gpu`` queue.

    ``requested`` (the --concurrency flag or ``worker.concurrency``) is kept when the worker serves no GPU
    queue or sees no GPU (its jobs then fail with TARGET_UNAVAILABLE, quickly); otherwise it is capped at
    the GPU count, so two jobs never share one GPU."""
    if "gpu" not in queues or not gpus:
        return requested
    return min(requested or len(gpus), len(gpus))


def child_gpu_env(
    pool_index: int | None, *, mem_limit_mb: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment entries for the child of a GPU job started by pool process ``pool_index``.

    ``CUDA_VISIBLE_DEVICES``: the one GPU of that pool slot; the memory limit; and the library path and
    NVIDIA variables the container runtime set, which the runner's minimal environment would drop."""
    environ = os.environ if environ is None else environ
    env = {MEM_LIMIT_ENV: str(mem_limit_mb)}
    gpus = visible_gpus(environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[(pool_index or 0) % len(gpus)]
    for name in ("LD_LIBRARY_PATH", "CUDA_HOME", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        if name in environ:
            env[name] = environ[name]
    return env


def pool_index() -> int | None:
    """This Celery pool process's index (0-based, stable across replacements); None outside a pool."""
    try:
        from billiard.process import current_process
    except ImportError:
        return None
    return getattr(current_process(), "index", None)


# ---------------------------------------------------------------------------------- provider options


def mem_limit_mb_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The job's GPU memory limit in MiB from the child's environment; 0 (no limit) when unset."""
    environ = os.environ if environ is None else environ
    raw = environ.get(MEM_LIMIT_ENV, "").strip()
    if not raw:
        return 0
    value = int(raw)
    if value < 0:
        raise ValueError(f"{MEM_LIMIT_ENV} must be >= 0, got {value}")
    return value


def _name(entry: Any) -> str:
    return entry if isinstance(entry, str) else entry[0]


def session_providers(providers: Sequence[Any], target: str, *, mem_limit_mb: int | None = None) -> list[Any]:
    """``providers`` (names or (name, options)) with the job's GPU options merged into the GPU EPs.

    CUDA EP: ``device_id`` 0, and with a limit ``gpu_mem_limit`` (the smaller of the job's and the recipe's)
    plus ``arena_extend_strategy=kSameAsRequested``; TensorRT EP: ``device_id`` 0. CPU targets and the CPU
    EP are returned unchanged."""
    if not is_gpu_target(target):
        return list(providers)
    limit_mb = mem_limit_mb_from_env() if mem_limit_mb is None else mem_limit_mb
    out: list[Any] = []
    for entry in providers:
        name = _name(entry)
        options = {} if isinstance(entry, str) else {str(k): str(v) for k, v in dict(entry[1]).items()}
        if name == CUDA_EP:
            options["device_id"] = "0"
            if limit_mb:
                limit = limit_mb << 20
                if options.get("gpu_mem_limit", "").isdigit():
                    limit = min(limit, int(options["gpu_mem_limit"]))
                options["gpu_mem_limit"] = str(limit)
                options["arena_extend_strategy"] = "kSameAsRequested"
        elif name == TRT_EP:
            options["device_id"] = "0"
        out.append((name, options) if options else name)
    return out


# --------------------------------------------------------------------------------------- CUDA graphs


def cuda_graph_eligibility(input_dims: Mapping[str, Sequence[Any]], target: str) -> str | None:
    """None when a model may be tried as a CUDA graph on ``target``, else the reason it may not.

    ``input_dims``: graph input name -> declared dims (ints, or names/None for symbolic ones). Static
    declared shapes, not just one benchmark shape: the graph goes into the artifact's recipe, and a user
    feeding another shape would replay kernels sized for the captured one."""
    if target != "cuda":
        return f"CUDA graphs are a CUDA EP feature; target is {target}"
    dynamic = [name for name, dims in input_dims.items() if any(not isinstance(d, int) or d <= 0 for d in dims)]
    if dynamic:
        return f"dynamic input shapes ({', '.join(dynamic[:4])}): a CUDA graph replays one shape"
    return None


def with_cuda_graph(recipe: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``recipe`` (a tune_session/shape_profile ``onnxforge.session`` recipe, or None) that turns
    on CUDA graphs for the CUDA EP."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in dict(recipe or {}).items()}
    providers = {k: dict(v) for k, v in dict(out.get("provider_options") or {}).items()}
    providers.setdefault(CUDA_EP, {})["enable_cuda_graph"] = "1"
    out["provider_options"] = providers
    return out
