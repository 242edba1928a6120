"""The CPU-side parts of the GPU worker (they run everywhere): one job per GPU, the child's pinned GPU and
memory limit, the CUDA EP options of every session, and bench/gpu.py's arguments and its no-GPU exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from core.settings import Settings
from onnxforge.cli import worker_concurrency
from workers import runner
from workers.gpu import (
    MEM_LIMIT_ENV,
    child_gpu_env,
    gpu_concurrency,
    mem_limit_mb_from_env,
    session_providers,
    visible_gpus,
)

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
GPU_PROVIDERS = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_visible_gpus_follow_cuda_visible_devices_when_it_is_set() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5f1c,GPU-77aa"}) == ["GPU-5f1c", "GPU-77aa"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]  # CUDA stops at the first invalid id


def test_gpu_concurrency_is_one_job_per_gpu_when_worker_serves_the_gpu_queue() -> None:
    assert gpu_concurrency(None, ["gpu"], ["0", "1", "2"]) == 3
    assert gpu_concurrency(8, ["gpu"], ["0", "1"]) == 2
    assert gpu_concurrency(1, ["cpu", "gpu"], ["0", "1"]) == 1
    assert gpu_concurrency(4, ["cpu"], ["0", "1"]) == 4
    assert gpu_concurrency(None, ["gpu"], []) is None  # no GPU: jobs fail fast with TARGET_UNAVAILABLE


def test_worker_command_sizes_the_pool_from_the_gpu_count_when_queue_is_gpu(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    settings = Settings(storage={"data_dir": tmp_path})
    assert worker_concurrency(settings, ["gpu"], None) == 2
    assert worker_concurrency(settings, ["gpu"], 6) == 2
    assert worker_concurrency(settings, ["cpu"], 6) == 6
    gpu_worker = Settings(storage={"data_dir": tmp_path}, worker={"queues": ["gpu"]})
    assert worker_concurrency(gpu_worker, None, None) == 2


def test_child_gpu_env_pins_one_gpu_per_pool_slot_when_several_are_visible() -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "4,5", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64", "AWS_SECRET": "x"}
    pinned = [child_gpu_env(i, mem_limit_mb=2048, environ=environ)["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert pinned == ["4", "5", "4", "5"]
    env = child_gpu_env(None, mem_limit_mb=2048, environ=environ)
    assert env == {MEM_LIMIT_ENV: "2048", "CUDA_VISIBLE_DEVICES": "4", "LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}


def test_runner_gives_gpu_children_the_memory_limit_setting_when_configured(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    settings = Settings(storage={"data_dir": tmp_path}, worker={"gpu_mem_limit_mb": 3072})
    env = runner._gpu_env(settings)
    assert env[MEM_LIMIT_ENV] == "3072" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert mem_limit_mb_from_env(env) == 3072


def test_settings_refuse_negative_gpu_memory_limit_when_configured_so(tmp_path) -> None:
    with pytest.raises(ValueError, match="gpu_mem_limit_mb"):
        Settings(storage={"data_dir": tmp_path}, worker={"gpu_mem_limit_mb": -1})


def test_session_providers_cap_cuda_memory_when_a_limit_is_set() -> None:
    providers = session_providers(GPU_PROVIDERS, "cuda", mem_limit_mb=512)
    assert providers == [
        (
            "CUDAExecutionProvider",
            {"device_id": "0", "gpu_mem_limit": str(512 << 20), "arena_extend_strategy": "kSameAsRequested"},
        ),
        "CPUExecutionProvider",
    ]


def test_session_providers_keep_the_lower_recipe_limit_and_its_options_when_both_set_one() -> None:
    recipe = [("CUDAExecutionProvider", {"gpu_mem_limit": str(256 << 20), "enable_cuda_graph": "1"})]
    (_, options), *_ = session_providers([*recipe, "CPUExecutionProvider"], "cuda", mem_limit_mb=1024)
    assert options["gpu_mem_limit"] == str(256 << 20) and options["enable_cuda_graph"] == "1"
    (_, options), *_ = session_providers(recipe, "cuda", mem_limit_mb=128)
    assert options["gpu_mem_limit"] == str(128 << 20)


def test_session_providers_leave_cpu_targets_and_unlimited_jobs_alone_when_no_limit_applies() -> None:
    assert session_providers(["CPUExecutionProvider"], "cpu", mem_limit_mb=512) == ["CPUExecutionProvider"]
    assert session_providers(GPU_PROVIDERS, "cuda", mem_limit_mb=0)[0] == ("CUDAExecutionProvider", {"device_id": "0"})
    trt = session_providers(["TensorrtExecutionProvider", *GPU_PROVIDERS], "tensorrt", mem_limit_mb=64)
    assert trt[0] == ("TensorrtExecutionProvider", {"device_id": "0"})
    assert trt[1][1]["gpu_mem_limit"] == str(64 << 20)


def test_mem_limit_from_env_refuses_negative_values_when_misconfigured() -> None:
    assert mem_limit_mb_from_env({}) == 0
    with pytest.raises(ValueError, match=MEM_LIMIT_ENV):
        mem_limit_mb_from_env({MEM_LIMIT_ENV: "-5"})


# ------------------------------------------------------------------------------------------ bench/gpu.py


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )


def test_bench_gpu_help_lists_its_options_when_asked() -> None:
    proc = _bench("--help")
    assert proc.returncode == 0, proc.stderr
    for option in ("--models", "--presets", "--batch", "--seq", "--quick", "--no-write", "--json"):
        assert option in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="this machine has the CUDA EP: bench.gpu would run the full benchmark")
def test_bench_gpu_exits_nonzero_and_writes_nothing_when_there_is_no_gpu(tmp_path) -> None:
    readme = REPO / "bench" / "README.md"
    before = readme.read_bytes()
    out = tmp_path / "results.json"
    proc = _bench("--quick", "--json", str(out))
    assert proc.returncode == 2
    assert "CUDA execution provider" in proc.stderr and "nothing measured or written" in proc.stderr
    assert not out.exists()
    assert readme.read_bytes() == before


def test_bench_gpu_render_puts_one_row_per_variant_between_its_markers() -> None:
    from bench import gpu

    args = gpu.parse_args(["--quick", "--no-write"])
    assert args.models == ["bert_encoder", "gpt2"] and args.max_seconds == 5.0
    rows = [
        {"model": "gpt2", "variant": "ORT default", "precision": "fp32", "p50_ms": 2.0, "p90_ms": 2.2,
         "speedup": 1.0, "cuda_graph": "-", "max_abs": 0.0},
        {"model": "gpt2", "variant": "onnxforge fp16", "precision": "fp16", "p50_ms": 1.0, "p90_ms": 1.1,
         "speedup": 2.0, "cuda_graph": "no: dynamic input shapes (input_ids)", "max_abs": 3e-3},
    ]  # fmt: skip
    info = {"gpu": "NVIDIA H100", "onnxruntime": "1.22.0", "date": "2025-01-01"}
    block = gpu.render(rows, "python -m bench.gpu --quick", info, args)
    assert block.startswith(gpu.TABLE_START) and block.endswith(gpu.TABLE_END)
    assert "| gpt2 | onnxforge fp16 | fp16 | 1.000 | 1.100 | 2.00x | 0.003 | no: dynamic input shapes" in block
