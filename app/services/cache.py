"""The result cache: the same model bytes with the same effective configuration, tool versions and hardware
class get the earlier job's artifact and reports at once, as a new job marked cached.

**Key** (``cache_key``, computed by the API for every submission and stored on the job)::

    sha256(canonical JSON of {
        model: sha256 of the upload, samples: sha256 of samples.npz or null,
        config: the effective configuration (below),
        pipeline: the server's pipeline settings (benchmark runs, rollback default, folding cap, ...),
        versions: core.hardware.runtime_versions() (onnxforge, a hash of the optimizer's source,
                  onnx, onnx-ir, onnxruntime),
        queue: cpu or gpu })

The effective configuration is the job's ``JobConfig`` with defaults filled in and the preset expanded: the
pass list with every pass's options validated and defaults filled, the tolerance actually applied, the
rollback setting actually applied, and the preset's name (the report records it). ``use_cache`` and
``callback_url`` are left out: they do not change the result. So ``{"preset": "safe"}``, ``{}`` (when safe is
the default preset) and ``{"preset": "safe", "seed": 0}`` share a key; a different seed, tolerance or pass
option does not.

**Hardware class.** Results depend on the machine: passes that are slower there are rolled back and the
report holds its latencies. The API cannot know which worker will take a job, so each worker records its
class on the jobs it completes (``hardware_class``, core/hardware.py: CPU model and ISA flags or GPU name,
CPUs available, and the worker's own tool versions). A cached result is reused only if its class is among
the classes of the last ``cache.hardware_sample_jobs`` jobs that *ran* (not cached ones) on the same queue:
a class of worker that still serves the queue, so the fresh run could have landed on the same kind of
machine. A pool replaced by other hardware (or upgraded workers) stops matching after that many jobs; a
mixed pool reuses results of any of its classes, which is what a fresh run would have drawn from anyway.

**Tenants.** Only the caller's own jobs are looked at, unless ``cache.cross_tenant`` is on. A cached job
shares the earlier job's blobs, so the report it serves names the earlier job's id and was made from the
earlier upload (same bytes; the file name in the report may differ).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from core.config import EXACT_TOLERANCE, JobConfig
from core.settings import Settings
from core.store import Job, JobStore

CACHE_KEY_VERSION = 1
# JobConfig fields that do not change the artifact or report.
SERVICE_ONLY_FIELDS = frozenset({"use_cache", "callback_url"})


def effective_config(config: JobConfig, settings: Settings) -> dict[str, Any]:
    """The configuration a worker will really run: defaults filled, preset expanded (see module docstring)."""
    from passes import registry  # deferred: the registry imports every pass module

    specs = config.pass_specs()
    if specs is not None:
        preset_name = None
        candidates = []
        tolerance = config.tolerance or EXACT_TOLERANCE
    else:
        preset = registry.get_preset(config.preset or settings.pipeline.default_preset)
        preset_name = preset.name
        specs = list(preset.specs)  # with the preset's own pass options (e.g. int8's fuse_transformer engines)
        candidates = list(preset.candidates)
        tolerance = config.tolerance or preset.tolerance
    passes = [{"name": p.name, "options": p.options.model_dump(mode="json")} for p in registry.build_passes(specs)]
    rest = config.model_dump(mode="json", exclude={"preset", "passes", "tolerance", *SERVICE_ONLY_FIELDS})
    rollback = config.rollback_slower if config.rollback_slower is not None else settings.pipeline.rollback_slower
    return {
        **rest,
        "preset": preset_name,
        "passes": passes,
        "candidates": candidates,  # preset auto: the presets it tries
        "tolerance": tolerance.model_dump(mode="json"),
        "rollback_slower": rollback,
    }


def cache_key(
    *,
    model_sha256: str,
    samples_sha256: str | None,
    config: JobConfig,
    queue: str,
    settings: Settings,
) -> str:
    from core.hardware import runtime_versions  # no Celery: versions and a source hash only

    material = {
        "v": CACHE_KEY_VERSION,
        "model": model_sha256,
        "samples": samples_sha256,
        "config": effective_config(config, settings),
        "pipeline": settings.pipeline.model_dump(mode="json"),
        "versions": runtime_versions(),
        "queue": queue,
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def lookup(store: JobStore, key: str, *, tenant: str, queue: str, settings: Settings) -> Job | None:
    """An earlier job whose result may be reused for ``key``, or None (see the module docstring)."""
    cache = settings.cache
    return store.find_cached(
        key,
        tenant=None if cache.cross_tenant else tenant,
        queue=queue,
        max_age_seconds=cache.max_age_seconds,
        hardware_sample_jobs=cache.hardware_sample_jobs,
    )
