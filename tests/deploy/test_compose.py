"""docker-compose.yml is checked by parsing it (no Docker engine here), and every command it runs that
exists on this machine is run for real: the redis and postgres healthchecks against the test servers
(tests/conftest.py: the shared ones, or private ones it starts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy._cli import assert_cli_accepts, assert_settings_accept_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_defines_the_stack_services(compose):
    assert set(compose["services"]) == {"redis", "postgres", "migrate", "api", "worker-cpu", "worker-gpu"}


ONE_SHOT = {"migrate"}  # runs to completion; nothing to health-check or restart


def test_compose_redis_keeps_an_append_only_file_and_never_evicts(compose):
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"


def test_compose_every_service_has_a_healthcheck_and_restart_policy(compose):
    for name, service in compose["services"].items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no" and "healthcheck" not in service, name
            continue
        assert "healthcheck" in service, f"{name} has no healthcheck"
        assert service.get("restart") == "unless-stopped", f"{name} has no restart policy"


@pytest.mark.parametrize("name", ["migrate", "api", "worker-cpu", "worker-gpu"])
def test_compose_onnxforge_commands_are_accepted_by_the_cli(compose, name):
    assert_cli_accepts(compose["services"][name]["command"])


@pytest.mark.parametrize("name", ["migrate", "api", "worker-cpu", "worker-gpu"])
def test_compose_environment_names_only_real_settings(compose, name):
    env = compose["services"][name]["environment"]
    assert env and all(k.startswith("ONNXFORGE_") for k in env)
    assert_settings_accept_env({k: str(v) for k, v in env.items()})


def test_compose_gpu_worker_is_a_profile_with_an_nvidia_reservation_on_the_gpu_queue(compose):
    service = compose["services"]["worker-gpu"]
    assert service["profiles"] == ["gpu"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    command = service["command"]
    assert command[command.index("--queues") + 1] == "gpu"


def test_compose_api_and_workers_share_the_blob_volume(compose):
    mounts = {name: compose["services"][name]["volumes"] for name in ("api", "worker-cpu", "worker-gpu")}
    assert all("blobs:/data" in m for m in mounts.values())
    assert "blobs" in compose["volumes"]


def test_compose_api_healthcheck_module_accepts_its_arguments(compose):
    from onnxforge import healthcheck

    for name in ("api", "worker-cpu", "worker-gpu"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "onnxforge.healthcheck"]
        healthcheck.build_parser().parse_args(test[4:])


@pytest.mark.parametrize(
    ("service", "binary", "server"),
    [("redis", "redis-cli", "redis_server"), ("postgres", "pg_isready", "postgres_server")],
)
def test_compose_dependency_healthchecks_succeed_against_test_servers(compose, service, binary, server, request):
    address = urlsplit(request.getfixturevalue(server))
    local_args = ["-h", str(address.hostname), "-p", str(address.port)]
    test = compose["services"][service]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == binary
    if shutil.which(binary) is None:
        package = "redis-tools" if binary == "redis-cli" else "postgresql-client"
        pytest.fail(f"{binary} is not installed: apt-get install {package}")
    argv = [binary, *local_args, *test[2:]]
    if service == "postgres":  # the compose user exists only in the compose database; check the server answers
        argv = [binary, *local_args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    assert result.returncode == 0, f"{' '.join(argv)} failed: {result.stdout}{result.stderr}"


def _time_limit(compose: dict, name: str) -> int:
    from core.settings import Settings

    env = compose["services"][name]["environment"]
    default = Settings.model_fields["worker"].default.task_time_limit
    return int(env.get("ONNXFORGE_WORKER__TASK_TIME_LIMIT", default))


def _seconds(duration: str) -> int:
    units = {"h": 3600, "m": 60, "s": 1}
    assert duration[-1] in units and duration[:-1].isdigit(), f"write grace periods as <n>s/m/h, got {duration}"
    return int(duration[:-1]) * units[duration[-1]]


@pytest.mark.parametrize("name", ["worker-cpu", "worker-gpu"])
def test_compose_worker_stop_grace_period_lets_a_running_job_finish(compose, name):
    grace = compose["services"][name].get("stop_grace_period")
    assert grace, f"{name}: Docker's default 10 s would kill the running job"
    assert _seconds(grace) > _time_limit(compose, name)


def test_compose_images_are_tagged_with_the_project_version_one_repository_per_flavour(compose):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {name: compose["services"][name]["image"] for name in ("api", "worker-cpu", "worker-gpu")}
    assert images == {"api": f"onnxforge:{version}", "worker-cpu": f"onnxforge:{version}",
                      "worker-gpu": f"onnxforge-gpu:{version}"}  # fmt: skip
    assert compose["services"]["api"]["build"]["target"] == "cpu"
    assert compose["services"]["worker-gpu"]["build"]["target"] == "gpu"


@pytest.mark.parametrize("name", ["worker-cpu", "worker-gpu"])
def test_compose_workers_unpack_jobs_on_their_own_volume_not_the_shared_one(compose, name):
    service = compose["services"][name]
    scratch = service["environment"]["ONNXFORGE_STORAGE__SCRATCH_DIR"]
    assert scratch in service["volumes"], f"{name}: {scratch} is not a volume of its own"
    data_dir = service["environment"]["ONNXFORGE_STORAGE__DATA_DIR"]
    assert not Path(scratch).is_relative_to(data_dir), f"{name}: scratch is on the shared volume"


@pytest.mark.parametrize("name", ["api", "worker-cpu", "worker-gpu"])
def test_compose_service_starts_after_migrate_succeeded_when_it_does_not_migrate_itself(compose, name, monkeypatch):
    from core.settings import Settings

    service = compose["services"][name]
    env = {k: str(v) for k, v in service["environment"].items()}
    for key in [k for k in os.environ if k.startswith("ONNXFORGE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Settings().database.auto_migrate is False, f"{name} would alter the schema at start"
    assert service["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    migrate = compose["services"]["migrate"]
    assert migrate["command"] == ["migrate"] and migrate["image"] == service["image"].replace("-gpu:", ":")
    assert migrate["environment"]["ONNXFORGE_DATABASE__URL"] == env["ONNXFORGE_DATABASE__URL"]
