"""The Dockerfile is checked by parsing it: no Docker engine runs on these machines.

What is checked is what would break a deployment silently: a stage missing, the service running as root,
no healthcheck, an entry point or command the CLI does not accept, an environment variable that is not a
setting (a typo there is ignored by the container and the default wins).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy._cli import assert_cli_accepts, assert_settings_accept_env

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    logical: list[str] = []
    buffer = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical.append(buffer + line)
        buffer = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), flags=re.IGNORECASE)
            assert match, f"unparsable FROM: {line}"
            stages.append(Stage(base=match.group(1), name=match.group(2)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            name, _, default = args.partition("=")
            global_args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, args.strip()))
    return global_args, stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"expected exec form (JSON array), got {args}"
    return value


def env_pairs(stage: Stage) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for args in stage.all("ENV"):
        for token in shlex.split(args):
            key, sep, value = token.partition("=")
            assert sep, f"ENV must use key=value form: {args}"
            pairs[key] = value
    return pairs


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], dict[str, Stage]]:
    global_args, stages = parse_dockerfile((ROOT / "Dockerfile").read_text())
    return global_args, {s.name: s for s in stages if s.name}


def test_dockerfile_has_build_cpu_and_gpu_stages(dockerfile):
    _, stages = dockerfile
    assert {"build", "cpu", "gpu"} <= set(stages)


def test_dockerfile_gpu_stage_runs_on_a_cuda_runtime_with_onnxruntime_gpu(dockerfile):
    global_args, stages = dockerfile
    assert stages["gpu"].base == "${CUDA_IMAGE}"
    assert "nvidia/cuda" in global_args["CUDA_IMAGE"] and "runtime" in global_args["CUDA_IMAGE"]
    assert any("onnxruntime-gpu" in run for run in stages["gpu"].all("RUN"))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_final_stage_runs_as_non_root_when_built(dockerfile, target):
    _, stages = dockerfile
    user = stages[target].last("USER")
    assert user is not None and user not in {"root", "0"}, f"{target} image runs as root"


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_final_stage_has_a_healthcheck_that_is_a_real_module(dockerfile, target):
    _, stages = dockerfile
    health = stages[target].last("HEALTHCHECK")
    assert health, f"{target} has no HEALTHCHECK"
    command = exec_form(health.split(" CMD ", 1)[1])
    assert command[:3] == ["python", "-m", "onnxforge.healthcheck"]
    from onnxforge import healthcheck

    healthcheck.build_parser().parse_args(command[3:])


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_entrypoint_and_cmd_are_accepted_by_the_cli(dockerfile, target):
    _, stages = dockerfile
    entrypoint = exec_form(stages[target].last("ENTRYPOINT"))
    assert entrypoint == ["onnxforge"], "the image must expose the same entry point as the CLI"
    assert_cli_accepts(exec_form(stages[target].last("CMD")))


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_env_names_only_real_settings(dockerfile, target):
    _, stages = dockerfile
    env = {k: v for k, v in env_pairs(stages[target]).items() if k.startswith("ONNXFORGE_")}
    assert env, "expected the image to set its data directory"
    assert_settings_accept_env(env)


def test_dockerfile_build_stage_copies_every_package_in_pyproject(dockerfile):
    _, stages = dockerfile
    copied = {args.split()[0] for args in stages["build"].all("COPY")}
    for package in ("onnxforge", "app", "workers", "passes"):
        assert package in copied, f"build stage does not copy {package}/"
