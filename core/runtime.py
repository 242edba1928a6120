"""Open an ONNX Runtime session the way the artifact's ``onnxforge.session`` recipe says.

``shape_profile`` (passes/session/shape_profile.py) measures session settings on a random-size call trace and writes
the one that lowers peak memory without slowing the trace into the model's ``metadata_props``::

    onnxforge.session = {"session_options": {"enable_mem_pattern": false},
                         "session_config": {"session.use_device_allocator_for_initializers": "1"},
                         "provider_options": {"CUDAExecutionProvider": {"arena_extend_strategy": "kSameAsRequested"}},
                         "warmup": [{"input_ids": [8, 512], "attention_mask": [8, 512]}]}

``load(path)`` applies it to a fresh ``InferenceSession`` and runs the warm-up calls. The recipe comes from
the model file, i.e. from whoever wrote that file: it is **untrusted**. Only whitelisted names with
type-checked values are applied (no ``optimized_model_filepath``, ``profile_file_prefix``, custom-op
libraries or file-writing config keys; warm-up shapes are bounded); anything else is skipped with a
``RecipeWarning``. The metadata is read by scanning the protobuf's top-level fields, without parsing the
graph or its weights, so reading the recipe adds nothing to the process's peak memory.

CPU arena growth (``provider_options["CPUExecutionProvider"]["arena_extend_strategy"]``) has no CPU EP
option in ORT; ``load`` realises it with a shared, process-wide CPU arena (``create_and_register_allocator``
+ ``session.use_env_allocators``). The first strategy registered in a process stays for its lifetime.

CUDA graphs (``provider_options["CUDAExecutionProvider"]["enable_cuda_graph"] = "1"``; the GPU benchmark
writes it for models with static input shapes when the captured graph is faster): ORT then replays one
captured launch sequence on fixed device addresses, so the session must be run with I/O binding on inputs
and outputs that stay where they are, which ``BoundRun`` does (``update`` copies new values into the same
buffers). ``load`` skips the recipe's warm-up calls for such a session: a plain ``run`` would capture the
graph on temporary buffers.

``python -m core.runtime --measure spec.json`` is the measurement child ``shape_profile`` and
``bench/shape_profile.py`` start, one fresh process per measurement (peak RSS only grows in a process):
it opens the session, replays a call trace and prints per-call latency, first-seen-shape flags and peak
memory as JSON. It imports numpy and onnxruntime only, so every candidate starts from the same baseline.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.recipe import (
    MAX_WARMUP_ELEMENTS,
    SESSION_OPTIONS,
    RecipeWarning,
    check_value,
    read_recipe,
    sanitize_recipe,
    warn_recipe,
)

_NP_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint64)": np.uint64,
    "tensor(uint32)": np.uint32,
    "tensor(uint16)": np.uint16,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


# ------------------------------------------------------------------------------------- the session

_ENV_ARENA: dict[str, str] = {}  # the process-wide CPU arena registered by load, if any: {"strategy": ...}


def _env_cpu_arena(strategy: str) -> bool:
    """Register the process-wide CPU arena with ``strategy`` once; True when sessions may use it."""
    import onnxruntime as ort

    if "strategy" in _ENV_ARENA:
        if _ENV_ARENA["strategy"] != strategy:
            warn_recipe(f"the process-wide CPU arena already uses {_ENV_ARENA['strategy']}; {strategy} is not applied")
        return True
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    # OrtArenaCfg(max_mem, arena_extend_strategy 0 = kNextPowerOfTwo / 1 = kSameAsRequested,
    #             initial_chunk_size_bytes, max_dead_bytes_per_chunk); -1 = ORT's default.
    cfg = ort.OrtArenaCfg(0, 1 if strategy == "kSameAsRequested" else 0, -1, -1)
    try:
        ort.create_and_register_allocator(info, cfg)
    except Exception as exc:  # registered by someone else in this process
        warn_recipe(f"could not register the CPU arena ({exc}); the default arena is used")
        return False
    _ENV_ARENA["strategy"] = strategy
    return True


def session_options(recipe: Mapping[str, Any] | None = None, **overrides: Any) -> Any:
    """``ort.SessionOptions`` with a sanitized recipe's options and config entries; ``overrides`` are
    session option names from ``SESSION_OPTIONS`` given by the caller (trusted, but still type-checked)."""
    import onnxruntime as ort

    recipe = recipe or {}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    values = dict(recipe.get("session_options", {}))
    for name, value in overrides.items():
        if name not in SESSION_OPTIONS:
            raise TypeError(f"unknown session option override {name!r} (known: {', '.join(SESSION_OPTIONS)})")
        values[name] = check_value(SESSION_OPTIONS[name], value)
    for name, value in values.items():
        if name == "graph_optimization_level":
            value = getattr(ort.GraphOptimizationLevel, value)  # noqa: PLW2901
        elif name == "execution_mode":
            value = getattr(ort.ExecutionMode, value)  # noqa: PLW2901
        setattr(options, name, value)
    for key, value in recipe.get("session_config", {}).items():
        options.add_session_config_entry(key, value)
    cpu = recipe.get("provider_options", {}).get("CPUExecutionProvider", {})
    strategy = cpu.get("arena_extend_strategy")
    if strategy and values.get("enable_cpu_mem_arena", True) and _env_cpu_arena(strategy):
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def _providers(recipe: Mapping[str, Any], providers: Sequence[Any] | None) -> list[Any]:
    """The provider list with the recipe's options merged in (the caller's own options win)."""
    import onnxruntime as ort

    by_recipe = {k: v for k, v in recipe.get("provider_options", {}).items() if k != "CPUExecutionProvider"}
    if providers is None:
        available = set(ort.get_available_providers())
        names = [p for p in by_recipe if p in available]
        providers = [*names, "CPUExecutionProvider"]
    out: list[Any] = []
    for entry in providers:
        name, own = (entry, {}) if isinstance(entry, str) else (entry[0], dict(entry[1]))
        merged = {**by_recipe.get(name, {}), **own}
        out.append((name, merged) if merged else name)
    return out


def _dtype(type_str: str) -> Any:
    return _NP_TYPES.get(type_str)


def warmup_feeds(session: Any, entry: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray] | None:
    """Feeds for one warm-up call: zeros of each input's dtype (ones for mask-like inputs), the shapes of
    ``entry``; inputs it leaves out get their symbolic dims bound from the ones it gives. None (with a
    RecipeWarning) when the entry does not fit the model."""
    inputs = {i.name: i for i in session.get_inputs()}
    bound: dict[str, int] = {}
    for name, shape in entry.items():
        spec = inputs.get(name)
        if spec is None:
            warn_recipe(f"warm-up names {name!r}, which is not an input of the model; warm-up call skipped")
            return None
        if len(shape) != len(spec.shape):
            warn_recipe(f"warm-up gives {name!r} rank {len(shape)}, the model expects {len(spec.shape)}; skipped")
            return None
        for dim, size in zip(spec.shape, shape, strict=True):
            if isinstance(dim, int) and dim != size:
                warn_recipe(f"warm-up gives {name!r} size {size} where the model fixes {dim}; skipped")
                return None
            if isinstance(dim, str):
                bound.setdefault(dim, size)
    feeds = {}
    for name, spec in inputs.items():
        dtype = _dtype(spec.type)
        if dtype is None:
            warn_recipe(f"warm-up cannot make an input of type {spec.type} ({name!r}); skipped")
            return None
        if name in entry:
            shape = list(entry[name])
        else:
            shape = []
            for dim in spec.shape:
                if isinstance(dim, int):
                    shape.append(dim)
                elif isinstance(dim, str) and dim in bound:
                    shape.append(bound[dim])
                else:
                    warn_recipe(f"warm-up leaves a dim of {name!r} unbound; skipped")
                    return None
        if math.prod(shape) > MAX_WARMUP_ELEMENTS:
            warn_recipe(f"warm-up shape {shape} of {name!r} is above {MAX_WARMUP_ELEMENTS} elements; skipped")
            return None
        fill = np.ones if "mask" in name.lower() else np.zeros
        feeds[name] = fill(shape, dtype=dtype)
    return feeds


def cuda_graph_enabled(recipe: Mapping[str, Any] | None) -> bool:
    """True when a sanitized recipe turns CUDA graphs on."""
    options = (recipe or {}).get("provider_options", {}).get("CUDAExecutionProvider", {})
    return str(options.get("enable_cuda_graph", "0")) == "1"


class BoundRun:
    """One feed bound to a session with I/O binding: the inputs copied to ``device`` once, outputs on the
    device. ``run()`` runs and waits for the outputs (``synchronize_outputs``), so a timer around it measures
    the model, not host<->device copies; ``outputs()`` copies them to the host.

    ``output_shapes`` (name -> (shape, numpy dtype)): outputs preallocated once at fixed addresses, which a
    CUDA graph session needs; None: ORT allocates each output on ``device`` per run. ``update(feeds)`` copies
    new values of the same shapes into the bound input buffers (addresses unchanged)."""

    def __init__(
        self,
        session: Any,
        feeds: Mapping[str, np.ndarray],
        device: str = "cpu",
        device_id: int = 0,
        output_shapes: Mapping[str, tuple[Sequence[int], Any]] | None = None,
    ) -> None:
        import onnxruntime as ort

        self.session = session
        self.device, self.device_id = device, device_id
        self.binding = session.io_binding()
        self.inputs = {
            name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), device, device_id)
            for name, value in feeds.items()
        }
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        self.fixed_outputs: dict[str, Any] = {}
        for output in session.get_outputs():
            if output_shapes is None:
                self.binding.bind_output(output.name, device, device_id)
                continue
            shape, dtype = output_shapes[output.name]
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, device_id)
            self.fixed_outputs[output.name] = value
            self.binding.bind_ortvalue_output(output.name, value)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def update(self, feeds: Mapping[str, np.ndarray]) -> None:
        for name, value in feeds.items():
            self.inputs[name].update_inplace(np.ascontiguousarray(value))

    def outputs(self) -> list[np.ndarray]:
        return list(self.binding.copy_outputs_to_cpu())


def session_from_recipe(
    path: str | os.PathLike[str],
    recipe: Mapping[str, Any] | None,
    providers: Sequence[Any] | None = None,
    *,
    warmup: bool = True,
    **overrides: Any,
) -> Any:
    """An ``InferenceSession`` on ``path`` with an already sanitized ``recipe`` (None: ORT's defaults)."""
    import onnxruntime as ort

    recipe = recipe or {}
    options = session_options(recipe, **overrides)
    session = ort.InferenceSession(str(path), sess_options=options, providers=_providers(recipe, providers))
    if warmup and cuda_graph_enabled(recipe) and recipe.get("warmup"):
        warn_recipe("warm-up calls are skipped: with CUDA graphs the first BoundRun captures the graph")
    elif warmup:
        for entry in recipe.get("warmup", []):
            feeds = warmup_feeds(session, entry)
            if feeds is None:
                continue
            try:
                session.run(None, feeds)
            except Exception as exc:  # a shape the model cannot take: the session is still good
                warn_recipe(f"warm-up call {dict(entry)} failed ({type(exc).__name__}: {str(exc)[:200]}); skipped")
    return session


def load(
    path: str | os.PathLike[str],
    providers: Sequence[Any] | None = None,
    *,
    warmup: bool = True,
    **overrides: Any,
) -> Any:
    """Open ``path`` with its ``onnxforge.session`` recipe applied and its warm-up calls run.

    A model without the key opens with ORT's defaults. ``providers``: as for ``InferenceSession``, the
    recipe's provider options are merged into matching entries (None: the recipe's providers that are
    available, then CPU). ``overrides``: session options that win over the recipe, e.g.
    ``intra_op_num_threads=2``.
    """
    return session_from_recipe(path, read_recipe(path), providers, warmup=warmup, **overrides)


# --------------------------------------------------------------------------- the measurement child


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_peak_rss() -> bool:
    """Restart the kernel's high-water mark of this process's RSS (Linux >= 4.0, /proc/self/clear_refs), so
    that the trace's peak is measured without the model load's transient one; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _hwm_bytes() -> int | None:
    """The RSS high-water mark since the last reset (VmHWM), or None where /proc has none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class _GpuMemory:
    """This process's GPU memory through NVML when pynvml is installed; None otherwise."""

    def __init__(self) -> None:
        self.nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            self.nvml = None

    def used(self) -> int | None:
        if self.nvml is None:
            return None
        total = 0
        for handle in self.handles:
            for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total


def measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Replay a call trace on one fresh session; meant to run alone in its process (``main``).

    ``spec``: ``model`` (path), ``trace`` (an .npz whose arrays are named ``<call>/<input>``), ``calls``,
    ``recipe`` (dict, sanitized here; null: ORT's defaults) or ``from_metadata`` (true: open with
    ``load``, i.e. the model's own recipe), ``providers`` (optional)."""
    with np.load(spec["trace"], allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    calls = int(spec["calls"])
    feeds = [
        {key.split("/", 1)[1]: arr for key, arr in arrays.items() if key.split("/", 1)[0] == str(i)}
        for i in range(calls)
    ]
    del arrays
    gpu = _GpuMemory()
    base_rss = _rss_bytes()
    providers = spec.get("providers")
    started = time.perf_counter()
    if spec.get("from_metadata"):
        recipe = read_recipe(spec["model"]) or {}
        session = load(spec["model"], providers)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecipeWarning)
            recipe = sanitize_recipe(spec.get("recipe") or {})
        session = session_from_recipe(spec["model"], recipe, providers)
    load_s = time.perf_counter() - started
    load_peak = _peak_rss_bytes()  # session creation and warm-up; the trace can only add to it
    loaded_rss = _rss_bytes()
    reset = _reset_peak_rss()
    names = {i.name for i in session.get_inputs()}
    seen = {tuple((k, tuple(v)) for k, v in sorted(entry.items())) for entry in recipe.get("warmup", [])}
    latency_ms: list[float] = []
    first_seen: list[bool] = []
    rss_mb: list[float] = []
    gpu_peak = gpu.used()
    for feed in feeds:
        feed = {k: v for k, v in feed.items() if k in names}  # noqa: PLW2901
        key = tuple(sorted((k, tuple(v.shape)) for k, v in feed.items()))
        first_seen.append(key not in seen)
        seen.add(key)
        start = time.perf_counter_ns()
        session.run(None, feed)
        latency_ms.append((time.perf_counter_ns() - start) / 1e6)
        rss_mb.append(_rss_bytes() / (1 << 20))
        used = gpu.used()
        if used is not None:
            gpu_peak = max(gpu_peak or 0, used)
    trace_peak = (_hwm_bytes() if reset else None) or max([loaded_rss, *(int(r * (1 << 20)) for r in rss_mb)])
    return {
        "latency_ms": latency_ms,
        "first_seen": first_seen,
        "rss_mb": rss_mb,
        "trace_s": sum(latency_ms) / 1000.0,
        "load_s": load_s,
        "base_rss_mb": base_rss / (1 << 20),
        "load_peak_rss_mb": load_peak / (1 << 20),
        "peak_rss_mb": _peak_rss_bytes() / (1 << 20),
        # The trace's own peak (arena growth and per-shape buffers on top of the loaded session), measured
        # from a high-water mark restarted after the load; without that, the largest RSS seen between calls.
        "loaded_rss_mb": loaded_rss / (1 << 20),
        "trace_peak_rss_mb": trace_peak / (1 << 20),
        "peak_gpu_mb": None if gpu_peak is None else gpu_peak / (1 << 20),
        "providers": session.get_providers(),
        "recipe": recipe,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--measure":
        print("usage: python -m core.runtime --measure spec.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[1]).read_text(encoding="utf-8"))
    result = measure(spec)
    out = spec.get("out")
    text = json.dumps(result)
    if out:
        Path(out).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
