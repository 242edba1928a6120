"""Memory runs: the attempt cap on a job that always runs out of memory (``oom``), one big zip upload
(``upload``), and the validator's peak memory on a big inline model (``validate``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.reliability._stack import (
    CONFIG,
    FAST_PIPELINE,
    MODEL,
    ROOT,
    TERMINAL,
    UPLOAD_BLOCK,
    Log,
    RedisServer,
    RssSampler,
    Stack,
    api_process,
    job_of_child,
    list_jobs,
    log_stderr,
    model_variants,
    submit,
    wait_terminal,
    workspace,
)

# ---------------------------------------------------------------------------------------------- OOM cap


def oom_model() -> bytes:
    """A tiny model whose first run allocates 64 GiB: ConstantOfShape of a shape hidden behind Identity, so no
    static check sees it and only the child's memory limit stops it (like T7's runtime memory bomb)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["shape"], ["shape2"], name="hide"),
            helper.make_node("ConstantOfShape", ["shape2"], ["big"], name="bomb"),
            helper.make_node("ReduceSum", ["big"], ["s"], name="sum", keepdims=0),
            helper.make_node("Add", ["x", "s"], ["y"], name="add"),
        ],
        "oom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[numpy_helper.from_array(np.array([1 << 34], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def run_oom(
    *,
    max_attempts: int = 3,
    lease_seconds: int = 10,
    reconcile_seconds: int = 2,
    child_memory_mb: int = 4096,
    timeout: float = 300.0,
    log: Log = log_stderr,
    tmp_parent: Path | None = None,
) -> dict[str, Any]:
    """The attempt cap (security.md T16) with one worker, lease ``lease_seconds``:

    A. a model whose run always exceeds the child's memory limit, then a good job behind it;
    B. a job whose every attempt takes its worker down with it, as when the kernel's OOM killer picks the
       worker rather than the child (no per-child cgroup yet, T7): the run SIGKILLs the worker's process
       group as soon as that job's attempt child appears, and restarts the worker; a good job waits behind.

    Each ends with the job's state, error code and attempts, and the good job's state."""
    result: dict[str, Any] = {"max_attempts": max_attempts, "lease_seconds": lease_seconds}
    result["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    with workspace(parent=tmp_parent) as tmp:
        redis = RedisServer(tmp / "redis")
        redis.start()
        stack = Stack(
            tmp, broker_url=redis.url, cache__enabled=False, worker__lease_seconds=lease_seconds,
            worker__reconcile_interval_seconds=reconcile_seconds, worker__max_attempts=max_attempts,
            worker__child_memory_mb=child_memory_mb, fault="sleep:1", **FAST_PIPELINE,
        )  # fmt: skip
        try:
            stack.start_api()
            worker = stack.start_worker()
            client = httpx.Client()
            good = model_variants(1)[0]

            # A: the child runs out of memory on every delivery.
            t0 = time.monotonic()
            oom_id = submit(client, stack.url, oom_model()).raise_for_status().json()["id"]
            after_oom = submit(client, stack.url, good).raise_for_status().json()["id"]
            final = wait_terminal(client, stack.url, [oom_id, after_oom], timeout)
            result["child_oom"] = {
                "state": final[oom_id]["state"],
                "error_code": (final[oom_id].get("error") or {}).get("code"),
                "attempts": final[oom_id]["attempts"],
                "next_job_state": final[after_oom]["state"],
                "seconds": round(time.monotonic() - t0, 2),
            }
            log(f"oom: child OOM {result['child_oom']}")

            # B: every attempt of one job kills its worker.
            t0 = time.monotonic()
            poison_id = submit(client, stack.url, good).raise_for_status().json()["id"]
            behind = submit(client, stack.url, good).raise_for_status().json()["id"]
            kills = 0
            deadline = t0 + timeout
            while time.monotonic() < deadline:
                jobs = list_jobs(client, stack.url)
                if jobs[poison_id]["state"] in TERMINAL and jobs[behind]["state"] in TERMINAL:
                    break
                if any(job_of_child(c)[0] == poison_id for c in stack.children()) and worker.alive:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(worker.popen.pid, signal.SIGKILL)
                    worker.popen.wait(10)
                    kills += 1
                    log(f"oom: killed the worker running {poison_id} ({kills})")
                if not worker.alive:
                    worker = stack.start_worker()
                time.sleep(0.2)
            final = list_jobs(client, stack.url)
            result["worker_killed_every_attempt"] = {
                "state": final[poison_id]["state"],
                "error_code": (final[poison_id].get("error") or {}).get("code"),
                "attempts": final[poison_id]["attempts"],
                "worker_kills": kills,
                "next_job_state": final[behind]["state"],
                "seconds": round(time.monotonic() - t0, 2),
            }
            log(f"oom: worker killed every attempt {result['worker_killed_every_attempt']}")
            client.close()
        finally:
            try:
                stack.close()
            finally:
                redis.stop()
        result["children_after_close"] = len(stack.children())
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


# ----------------------------------------------------------------------------------------- big uploads


def write_big_archive(path: Path, data_bytes: int) -> tuple[int, int]:
    """A zip (stored) of ``model.onnx`` with one float32 initializer of ``data_bytes`` in ``weights.bin``,
    streamed to disk in 1 MiB blocks. Returns (archive size, model.onnx size)."""
    import onnx
    from onnx import TensorProto, helper

    data_bytes -= data_bytes % 4
    init = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[data_bytes // 4])
    init.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(data_bytes))):
        entry = init.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)],
        "big",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        initializer=[init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto = model.SerializeToString()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(zipfile.ZipInfo("model.onnx", date_time=(1980, 1, 1, 0, 0, 0)), proto)
        info = zipfile.ZipInfo("weights.bin", date_time=(1980, 1, 1, 0, 0, 0))
        with zf.open(info, "w", force_zip64=True) as out:
            left = data_bytes
            while left:
                n = min(left, len(UPLOAD_BLOCK))
                out.write(UPLOAD_BLOCK[:n])
                left -= n
    del onnx
    return path.stat().st_size, len(proto)


def multipart_stream(
    path: Path, boundary: str, config: dict[str, Any], name: str = "model.zip"
) -> tuple[int, Iterator[bytes]]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="config"\r\n\r\n{json.dumps(config)}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="{name}"\r\n'
        "Content-Type: application/zip\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    size = len(head) + path.stat().st_size + len(tail)

    def chunks() -> Iterator[bytes]:
        yield head
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                yield block
        yield tail

    return size, chunks()


def run_upload(*, gb: float = 2.2, log: Log = log_stderr, tmp_parent: Path | None = None) -> dict[str, Any]:
    """Upload a zip of model.onnx + ``gb`` GB of external data over loopback (streamed, with Content-Length);
    measure throughput and the API process's RSS increase; then validate the extracted model in a
    subprocess and report its peak RSS."""
    result: dict[str, Any] = {"data_gb": gb, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    with workspace(parent=tmp_parent) as tmp:
        archive = tmp / "big.zip"
        t = time.monotonic()
        size, proto_size = write_big_archive(archive, int(gb * 1e9))
        result["archive_bytes"] = size
        result["generate_seconds"] = round(time.monotonic() - t, 2)
        log(f"upload: archive {size / 1e9:.2f} GB written in {result['generate_seconds']} s")
        stack = Stack(tmp, worker__embedded_workers=0, api__max_upload_bytes=max(4 << 30, size + (1 << 20)))
        try:
            stack.start_api()
            with httpx.Client() as c:  # warm the app (imports, DB) before the baseline
                submit(c, stack.url, MODEL.read_bytes())
            time.sleep(0.5)
            boundary = uuid.uuid4().hex
            length, body = multipart_stream(archive, boundary, CONFIG)
            with archive.open("rb") as f:  # streamed: the archive may be larger than this machine's free memory
                digest = hashlib.file_digest(f, "sha256")
            with RssSampler(api_process(stack).pid) as rss:
                t = time.monotonic()
                r = httpx.post(
                    f"{stack.url}/v1/jobs",
                    content=body,
                    headers={
                        "Content-Type": f"multipart/form-data; boundary={boundary}",
                        "Content-Length": str(length),
                    },
                    timeout=600,
                )
                elapsed = time.monotonic() - t
            result.update(
                status=r.status_code,
                upload_seconds=round(elapsed, 2),
                throughput_mb_s=round(length / elapsed / 1e6, 1),
                api_rss_baseline_mb=round(rss.baseline / 2**20, 1),
                api_rss_peak_mb=round(rss.peak / 2**20, 1),
                api_rss_increase_mb=round((rss.peak - rss.baseline) / 2**20, 1),
            )
            if r.status_code == 202:
                job = r.json()
                result["sha256_matches"] = job["model"]["sha256"] == digest.hexdigest()
                result["model_format"] = job["model"]["format"]
            else:
                result["error"] = r.text[:500]
            log(
                f"upload: {r.status_code} {result.get('throughput_mb_s')} MB/s, "
                f"API RSS +{result['api_rss_increase_mb']} MB"
            )
        finally:
            stack.close()
        # Validation: extract (as the worker does) and validate in a fresh process; peak RSS from VmHWM.
        extract = tmp / "job" / "attempt-1" / "input"
        extract.mkdir(parents=True)
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(extract)
        archive.unlink()
        result["validate"] = validate_peak(extract / "model.onnx", tmp / "job")
        result["validate"]["model_onnx_bytes"] = proto_size
    return result


_VALIDATE_PROBE = r"""
import json, resource, sys, time
from pathlib import Path
from workers.validate import validate_model_dir
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
t = time.monotonic()
try:
    validate_model_dir(Path(sys.argv[1]), Path(sys.argv[2]))
    outcome = "ok"
except Exception as exc:
    outcome = getattr(exc, "code", type(exc).__name__)
seconds = round(time.monotonic() - t, 3)
print(json.dumps({"outcome": outcome, "seconds": seconds, "hwm_before": before, "hwm_after": hwm()}))
"""


def validate_peak(model: Path, job_dir: Path) -> dict[str, Any]:
    """Run workers.validate.validate_model_dir in a subprocess; peak RSS (VmHWM) before and after."""
    out = subprocess.run(
        [sys.executable, "-c", _VALIDATE_PROBE, str(model), str(job_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    data = json.loads(out.stdout.strip().splitlines()[-1])
    size = model.stat().st_size
    data["model_onnx_mb"] = round(size / 2**20, 2)
    data["peak_increase_mb"] = round((data["hwm_after"] - data["hwm_before"]) / 2**20, 1)
    data["peak_increase_over_model"] = round((data["hwm_after"] - data["hwm_before"]) / size, 2)
    return data


def run_validate(*, mb: float = 300.0, tmp_parent: Path | None = None) -> dict[str, Any]:
    """Validator peak memory on a model.onnx of ``mb`` MB of inline weights (the 1.5x target of (b))."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    with workspace(parent=tmp_parent) as tmp:
        folder = tmp / "job" / "attempt-1" / "input"
        folder.mkdir(parents=True)
        n = int(mb * 1e6) // 4
        w = numpy_helper.from_array(
            np.frombuffer(UPLOAD_BLOCK * (n * 4 // len(UPLOAD_BLOCK) + 1), dtype=np.float32)[:n], "w"
        )
        graph = helper.make_graph(
            [helper.make_node("ReduceSum", ["w"], ["y"], keepdims=0)],
            "inline",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
            initializer=[w],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        (folder / "model.onnx").write_bytes(model.SerializeToString())
        del model, graph, w, onnx
        return validate_peak(folder / "model.onnx", tmp / "job")
