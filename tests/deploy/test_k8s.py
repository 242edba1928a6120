"""deploy/k8s is checked without a cluster: no kubectl, no kustomize binary, no API server here.

The kustomizations are rendered by a small pure-Python renderer for the subset of kustomize they use
(resources, components, namespace, images, patches with strategic merge and ``$patch: delete``,
replacements); a key it does not know fails the test, so the manifests cannot drift beyond what is
checked. Where kubectl is installed, the renderer is checked against ``kubectl kustomize``. Every rendered
object is validated against the Kubernetes JSON schemas shipped by the PyPI package ``kubernetes-validate``
(strict: unknown fields fail), and the custom resources (KEDA, Prometheus Operator) against the minimal
schemas in tests/deploy/schemas. Then what would break a deployment silently: commands the CLI refuses,
``ONNXFORGE_*`` names that are no setting, a Secret key nobody creates, a container without resources,
root, the GPU worker without a GPU, a NetworkPolicy that lets other pods reach Redis, a ScaledObject
watching a Redis list the workers never fill. The last one is also checked for real: a local
redis-server started with the manifest's own arguments (ACL included) receives a job from onnxforge's
Dispatcher, and the list the ScaledObject names holds it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy._cli import assert_cli_accepts, assert_settings_accept_env

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
SECRET_EXAMPLE = K8S / "base" / "secret.example.yaml"

# Kubernetes versions the manifests must validate against: the oldest we support and the newest the
# installed kubernetes-validate knows.
OLDEST_K8S = "1.29"

CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
CUSTOM_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_v1alpha1_scaledobject.json",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda.sh_v1alpha1_triggerauthentication.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.json",
}
POD_OWNERS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}


# ------------------------------------------------------------------------------------- the renderer


class KustomizeError(AssertionError):
    pass


_KEYS = {
    "Kustomization": {
        "apiVersion",
        "kind",
        "namespace",
        "resources",
        "components",
        "images",
        "patches",
        "replacements",
    },
    "Component": {"apiVersion", "kind", "resources", "components", "images", "patches"},
}


def _read_kustomization(directory: Path, kind: str) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory} has no kustomization.yaml")
    data = yaml.safe_load(path.read_text())
    if data.get("kind", "Kustomization") != kind:
        raise KustomizeError(f"{path} is a {data.get('kind')}, expected a {kind}")
    unknown = set(data) - _KEYS[kind]
    if unknown:
        raise KustomizeError(f"{path} uses {sorted(unknown)}, which the test renderer does not implement")
    return data


def _ident(doc: dict[str, Any]) -> tuple[str, str, str]:
    group = doc["apiVersion"].rpartition("/")[0]
    return (group, doc["kind"], doc["metadata"]["name"])


def _load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _merge(target: Any, patch: Any) -> Any:
    """Strategic merge, as far as these manifests need it: maps merge, lists of named maps merge by name."""
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            merged[key] = _merge(target[key], value) if key in target else copy.deepcopy(value)
        return merged
    if (
        isinstance(target, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in [*target, *patch])
    ):
        merged_list = [copy.deepcopy(x) for x in target]
        index = {x["name"]: i for i, x in enumerate(merged_list)}
        for item in patch:
            if item["name"] in index:
                merged_list[index[item["name"]]] = _merge(merged_list[index[item["name"]]], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)


def _apply_patch(docs: list[dict[str, Any]], entry: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown:
        raise KustomizeError(f"patch keys {sorted(unknown)} are not implemented by the test renderer")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if "target" in entry:
        target = entry["target"]
        if set(target) - {"kind", "name"}:
            raise KustomizeError(f"patch target {target} is not implemented by the test renderer")
        kind, name = target.get("kind"), target.get("name")
        matches = [d for d in docs if kind in {None, d["kind"]} and name in {None, d["metadata"]["name"]}]
    else:
        matches = [d for d in docs if _ident(d) == _ident(patch)]
    if not matches:
        raise KustomizeError(f"patch {entry} matches no resource")
    if patch.get("$patch") == "delete":
        gone = {id(d) for d in matches}
        return [d for d in docs if id(d) not in gone]
    body = {k: v for k, v in patch.items() if k not in {"apiVersion", "kind"}}
    body["metadata"] = {k: v for k, v in body.get("metadata", {}).items() if k != "name"}
    return [_merge(d, body) if any(d is m for m in matches) else d for d in docs]


def _pod_template(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    return spec["template"]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in POD_OWNERS:
        return _pod_template(doc)["spec"]
    return None


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = _pod_spec(doc)
    return [] if spec is None else [*spec.get("initContainers", []), *spec["containers"]]


def _split_image(image: str) -> tuple[str, str | None, str | None]:
    image, _, digest = image.partition("@")
    name, tag = image, None
    if ":" in image.rsplit("/", 1)[-1]:
        name, tag = image.rsplit(":", 1)
    return name, tag, digest or None


def _apply_images(docs: list[dict[str, Any]], images: list[dict[str, Any]]) -> None:
    for entry in images:
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise KustomizeError(f"images keys {sorted(unknown)} are not implemented by the test renderer")
        for doc in docs:
            for container in _containers(doc):
                name, tag, digest = _split_image(container["image"])
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                tag = entry.get("newTag", tag)
                digest = entry.get("digest", digest)
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _expand_paths(doc: dict[str, Any], path: str) -> list[str]:
    """``a.*.b`` -> ``a.0.b``, ``a.1.b``... (kustomize's wildcard over list items)."""
    head, star, tail = path.partition(".*")
    if not star:
        return [path]
    items = _get_path(doc, head)
    return [p for i in range(len(items)) for p in _expand_paths(doc, f"{head}.{i}{tail}")]


def _get_path(doc: dict[str, Any], path: str) -> Any:
    node: Any = doc
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _apply_replacements(docs: list[dict[str, Any]], replacements: list[dict[str, Any]], directory: Path) -> None:
    """kustomize ``replacements`` (inline; source by kind/name; targets by kind/name; delimiter/index)."""
    for entry in replacements:
        if set(entry) - {"source", "targets"} or set(entry["source"]) - {"kind", "name", "fieldPath"}:
            raise KustomizeError(f"{directory}: replacement {entry} is not implemented by the test renderer")
        source = entry["source"]
        sources = [d for d in docs if d["kind"] == source["kind"] and d["metadata"]["name"] == source["name"]]
        if len(sources) != 1:
            raise KustomizeError(f"{directory}: replacement source {source} matches {len(sources)} resources")
        value = _get_path(sources[0], source["fieldPath"])
        for target in entry["targets"]:
            if set(target) - {"select", "fieldPaths", "options"} or set(target["select"]) - {"kind", "name"}:
                raise KustomizeError(f"{directory}: replacement target {target} is not implemented")
            options = target.get("options", {})
            if set(options) - {"delimiter", "index"}:
                raise KustomizeError(f"{directory}: replacement options {options} are not implemented")
            select = target["select"]
            for doc in docs:
                if select.get("kind", doc["kind"]) != doc["kind"]:
                    continue
                if select.get("name", doc["metadata"]["name"]) != doc["metadata"]["name"]:
                    continue
                for path in [p for pattern in target["fieldPaths"] for p in _expand_paths(doc, pattern)]:
                    new = value
                    if "delimiter" in options:
                        parts = str(_get_path(doc, path)).split(options["delimiter"])
                        parts[options.get("index", 0)] = str(value)
                        new = options["delimiter"].join(parts)
                    _set_path(doc, path, new)


def _build(data: dict[str, Any], directory: Path) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for entry in data.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += _build(_read_kustomization(path, "Kustomization"), path)
        elif path.is_file():
            docs += _load_yaml_docs(path)
        else:
            raise KustomizeError(f"{directory}: resource {entry} does not exist")
    for entry in data.get("components", []):
        path = (directory / entry).resolve()
        component = _read_kustomization(path, "Component")
        docs = [*docs, *_build({k: v for k, v in component.items() if k == "resources"}, path)]
        if component.get("components"):
            raise KustomizeError(f"{path}: nested components are not implemented by the test renderer")
        for patch in component.get("patches", []):
            docs = _apply_patch(docs, patch, path)
        _apply_images(docs, component.get("images", []))
    for patch in data.get("patches", []):
        docs = _apply_patch(docs, patch, directory)
    if "namespace" in data:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = data["namespace"]
    # After the namespace, as kustomize does within one kustomization (a component's run before it).
    _apply_replacements(docs, data.get("replacements", []), directory)
    _apply_images(docs, data.get("images", []))
    seen: set[tuple[str, str, str]] = set()
    for doc in docs:
        if _ident(doc) in seen:
            raise KustomizeError(f"{directory}: {_ident(doc)} is defined twice")
        seen.add(_ident(doc))
    return docs


def render(directory: Path, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory``; ``extra`` adds list entries (e.g. components) or replaces a
    scalar (e.g. the namespace), as an operator would."""
    data = _read_kustomization(directory, "Kustomization")
    for key, value in (extra or {}).items():
        data[key] = [*data.get(key, []), *value] if isinstance(value, list) else value
    return _build(copy.deepcopy(data), directory)


# --------------------------------------------------------------------------------------------- helpers

# Ready while the database and storage answer, whatever the broker does (status, reports, downloads).
READINESS_PATH = "/readyz?ignore=broker"

OVERLAYS = {
    "cpu-only": (K8S / "overlays" / "cpu-only", None),
    "gpu": (K8S / "overlays" / "gpu", None),
    # What docs/deploy.md tells operators to add: an external database and the Prometheus Operator.
    "gpu+components": (
        K8S / "overlays" / "gpu",
        {"components": ["../../components/external-postgres", "../../components/prometheus-operator"]},
    ),
}


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    directory, extra = OVERLAYS[request.param]
    return request.param, render(directory, extra)


@pytest.fixture(scope="module")
def secret() -> dict[str, Any]:
    (doc,) = _load_yaml_docs(SECRET_EXAMPLE)
    return doc


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


IMAGES = {"onnxforge", "onnxforge-gpu"}  # one repository per flavour; the tag is the version


def _is_onnxforge(container: dict[str, Any]) -> bool:
    return _split_image(container["image"])[0].rsplit("/", 1)[-1] in IMAGES


def _onnxforge_workloads(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(d, c) for d in docs for c in _containers(d) if _is_onnxforge(c)]


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _container_env(container: dict[str, Any], docs: list[dict[str, Any]], secret: dict[str, Any]) -> dict[str, str]:
    """The environment the container would see, with Secret values from secret.example.yaml."""
    configmaps = _by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"unexpected envFrom {source}"
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom names ConfigMap {name}, which is not rendered"
        env.update({k: str(v) for k, v in configmaps[name]["data"].items()})
    for var in container.get("env", []):
        if "value" in var:

            def expand(match: re.Match[str], defined: dict[str, str] = env, name: str = var["name"]) -> str:
                ref = match.group(1)
                assert ref in defined, f"{name} uses $({ref}), which is not defined before it"
                return defined[ref]

            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, var["value"])
        elif "resourceFieldRef" in var["valueFrom"]:
            env[var["name"]] = str(_resource_field(container, var["valueFrom"]["resourceFieldRef"]))
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"], f"{var['name']} reads Secret {ref['name']}"
            assert ref["key"] in secret["stringData"], f"{var['name']} reads key {ref['key']} nobody creates"
            env[var["name"]] = secret["stringData"][ref["key"]]
    return env


def _cpu_quantity(value: str | int) -> float:
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _resource_field(container: dict[str, Any], ref: dict[str, Any]) -> int:
    """What the downward API puts in the variable: the resource divided by the divisor, rounded up."""
    assert ref.get("containerName", container["name"]) == container["name"], f"{ref} names another container"
    kind, _, resource = ref["resource"].partition(".")
    assert resource == "cpu" and kind in {"limits", "requests"}, f"{ref} is not a CPU quantity"
    quantity = container["resources"][kind][resource]
    return math.ceil(_cpu_quantity(quantity) / _cpu_quantity(ref.get("divisor", "1")))


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{argv} has no {flag}"
    return argv[argv.index(flag) + 1]


# ------------------------------------------------------------------------------------------ rendering


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    with pytest.raises(KustomizeError, match="configMapGenerator"):
        render(tmp_path)


def test_renderer_merges_patches_and_deletes(tmp_path):
    (tmp_path / "d.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a}\n"
        "spec: {replicas: 1, template: {spec: {containers: [{name: c, image: 'x:1', args: [a]}]}}}\n"
        "---\napiVersion: v1\nkind: Service\nmetadata: {name: a}\n"
    )
    (tmp_path / "kustomization.yaml").write_text(
        "namespace: n\nresources: [d.yaml]\nimages: [{name: x, newName: r/x}]\npatches:\n"
        "  - patch: |\n      apiVersion: apps/v1\n      kind: Deployment\n      metadata: {name: a}\n"
        "      spec: {replicas: 3, template: {spec: {containers: [{name: c, args: [b]}]}}}\n"
        "  - patch: |\n      $patch: delete\n      apiVersion: v1\n      kind: Service\n      metadata: {name: a}\n"
    )
    (doc,) = render(tmp_path)
    assert doc["spec"]["replicas"] == 3 and doc["metadata"]["namespace"] == "n"
    assert doc["spec"]["template"]["spec"]["containers"] == [{"name": "c", "image": "r/x:1", "args": ["b"]}]


def test_every_kustomization_renders_the_expected_objects():
    cpu = {(d["kind"], d["metadata"]["name"]) for d in render(K8S / "overlays" / "cpu-only")}
    gpu = {(d["kind"], d["metadata"]["name"]) for d in render(K8S / "overlays" / "gpu")}
    core = {
        ("ConfigMap", "onnxforge-settings"),
        ("PersistentVolumeClaim", "onnxforge-data"), ("Service", "api"), ("Deployment", "api"),
        ("Deployment", "worker-cpu"), ("Service", "redis"), ("StatefulSet", "redis"),
        ("Service", "postgres"), ("StatefulSet", "postgres"), ("NetworkPolicy", "redis"),
        ("NetworkPolicy", "postgres"), ("TriggerAuthentication", "onnxforge-redis"),
        ("ScaledObject", "worker-cpu"), ("CronJob", "purge"),
    }  # fmt: skip
    assert cpu == core
    assert gpu == core | {("Deployment", "worker-gpu"), ("ScaledObject", "worker-gpu")}
    external = render(*OVERLAYS["gpu+components"])
    names = {(d["kind"], d["metadata"]["name"]) for d in external}
    assert not {n for n in names if n[1] == "postgres"}, "external-postgres left in-cluster PostgreSQL objects"
    assert ("ServiceMonitor", "onnxforge-api") in names


def test_everything_lands_in_one_namespace(rendered):
    _, docs = rendered
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in CLUSTER_SCOPED}
    assert namespaces == {"onnxforge"}


# ------------------------------------------------------------------------------------------- schemas


def _k8s_versions() -> list[str]:
    try:
        from kubernetes_validate.utils import latest_version, major_minor
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[test]' (it ships the schemas)")
    return [OLDEST_K8S, major_minor(latest_version())]


def _validate(doc: dict[str, Any], version: str) -> None:
    import jsonschema
    import kubernetes_validate

    key = (doc["apiVersion"], doc["kind"])
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    if key in CUSTOM_SCHEMAS:
        schema = json.loads((SCHEMAS / CUSTOM_SCHEMAS[key]).read_text())
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
        assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{where} is invalid for Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{where}: {exc.message} (add a schema under tests/deploy/schemas)")


def test_every_object_validates_against_the_kubernetes_schemas(rendered, secret):
    _, docs = rendered
    for version in _k8s_versions():
        for doc in [*docs, secret]:
            _validate(doc, version)


def test_schema_validation_catches_typos(rendered):
    _, docs = rendered
    (version, *_) = _k8s_versions()
    api = copy.deepcopy(_by_kind(docs, "Deployment")["api"])
    api["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(pytest.fail.Exception, match="resource"):
        _validate(api, version)
    scaled = copy.deepcopy(_by_kind(docs, "ScaledObject")["worker-cpu"])
    scaled["spec"]["triggers"][0]["metadata"]["listname"] = "x"
    with pytest.raises(AssertionError, match="listname"):
        _validate(scaled, version)


# ---------------------------------------------------------------------------- commands and settings


def test_onnxforge_containers_run_commands_the_cli_accepts(rendered):
    _, docs = rendered
    workloads = _onnxforge_workloads(docs)
    assert workloads
    for doc, container in workloads:
        assert container.get("command", ["onnxforge"]) == ["onnxforge"], f"{doc['metadata']['name']} overrides it"
        assert container.get("args"), f"{doc['metadata']['name']} relies on the image's CMD"
        assert_cli_accepts(container["args"])


def test_exec_probes_run_commands_that_exist(rendered):
    from onnxforge import healthcheck

    _, docs = rendered
    for doc in docs:
        for container in _containers(doc):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                argv = container.get(probe, {}).get("exec", {}).get("command")
                if not argv:
                    continue
                if argv[:3] == ["python", "-m", "onnxforge.healthcheck"]:
                    healthcheck.build_parser().parse_args(argv[3:])
                else:
                    assert argv[0] in {"redis-cli", "pg_isready"}, f"{doc['metadata']['name']}: {argv}"


def test_onnxforge_environment_names_only_real_settings_and_validates(rendered, secret):
    _, docs = rendered
    for _doc, container in _onnxforge_workloads(docs):
        env = _container_env(container, docs, secret)
        settings_env = {k: v for k, v in env.items() if k.startswith("ONNXFORGE_")}
        assert settings_env["ONNXFORGE_ENVIRONMENT"] == "production"
        assert_settings_accept_env(settings_env)  # production: needs and gets broker and database URLs


def test_every_secret_and_configmap_reference_resolves(rendered, secret):
    _, docs = rendered
    for doc in docs:
        for container in _containers(doc):
            _container_env(container, docs, secret)
    for auth in _by_kind(docs, "TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    configmap = _by_kind(docs, "ConfigMap")["onnxforge-settings"]
    assert all(key.startswith("ONNXFORGE_") for key in configmap["data"])


def test_api_probes_healthz_for_liveness_and_readyz_for_readiness(rendered):
    _, docs = rendered
    (api,) = _by_kind(docs, "Deployment")["api"]["spec"]["template"]["spec"]["containers"]
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert api["readinessProbe"]["httpGet"]["path"] == READINESS_PATH
    ports = {p["name"]: p["containerPort"] for p in api["ports"]}
    assert ports[api["livenessProbe"]["httpGet"]["port"]] == int(_flag(api["args"], "--port"))


# ------------------------------------------------------------------------- resources and security


def test_every_container_sets_cpu_and_memory_requests_and_limits(rendered):
    _, docs = rendered
    for doc in docs:
        for container in _containers(doc):
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(resources.get(kind, {}))
                assert not missing, f"{doc['metadata']['name']}/{container['name']} has no {kind} for {missing}"


def test_every_pod_runs_as_non_root_with_a_read_only_root_and_a_writable_tmp(rendered):
    _, docs = rendered
    for doc in docs:
        spec = _pod_spec(doc)
        if spec is None:
            continue
        name = doc["metadata"]["name"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in _containers(doc):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
            assert sc["readOnlyRootFilesystem"] is True, name
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{name}: /tmp is not an emptyDir"
        if any(_is_onnxforge(c) for c in _containers(doc)):
            assert pod["runAsUser"] == 10001, f"{name}: the Dockerfile's user is 10001"


def test_api_and_workers_share_the_read_write_many_data_volume_at_the_data_dir(rendered, secret):
    _, docs = rendered
    claims = _by_kind(docs, "PersistentVolumeClaim")
    for doc, container in _onnxforge_workloads(docs):
        data_dir = _container_env(container, docs, secret)["ONNXFORGE_STORAGE__DATA_DIR"]
        volumes = {v["name"]: v for v in _pod_spec(doc)["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data_dir]
        claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_gpu_worker_requests_one_gpu_runs_one_job_and_lands_on_gpu_nodes(rendered):
    name, docs = rendered
    deployments = _by_kind(docs, "Deployment")
    if name == "cpu-only":
        assert "worker-gpu" not in deployments
        assert not any("nvidia.com/gpu" in json.dumps(c.get("resources")) for d in docs for c in _containers(d))
        return
    spec = deployments["worker-gpu"]["spec"]["template"]["spec"]
    (worker,) = spec["containers"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _flag(worker["args"], "--queues") == "gpu" and _flag(worker["args"], "--concurrency") == "1"
    assert _split_image(worker["image"])[0].rsplit("/", 1)[-1] == "onnxforge-gpu"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]) and spec["nodeSelector"]


def test_worker_grace_period_lets_a_running_job_finish(rendered, secret):
    _, docs = rendered
    for doc, container in _onnxforge_workloads(docs):
        if container["args"][0] != "worker":
            continue
        limit = int(_container_env(container, docs, secret)["ONNXFORGE_WORKER__TASK_TIME_LIMIT"])
        assert _pod_spec(doc)["terminationGracePeriodSeconds"] > limit, doc["metadata"]["name"]


# ------------------------------------------------------------------------------------------- Redis


def _redis_command(docs: list[dict[str, Any]]) -> list[str]:
    (container,) = _by_kind(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"]
    return container["command"]


def test_redis_keeps_an_append_only_file_on_a_volume_and_never_evicts(rendered):
    _, docs = rendered
    redis = _by_kind(docs, "StatefulSet")["redis"]
    command = _redis_command(docs)
    assert _flag(command, "--appendonly") == "yes"
    assert _flag(command, "--maxmemory-policy") == "noeviction"
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    (data,) = [m for m in container["volumeMounts"] if m["mountPath"] == _flag(command, "--dir")]
    assert data["name"] in {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    maxmemory = _flag(command, "--maxmemory")
    assert maxmemory.endswith("mb") and container["resources"]["limits"]["memory"].endswith("Gi")
    assert int(maxmemory[:-2]) < 1024 * int(container["resources"]["limits"]["memory"][:-2])


def test_redis_needs_auth_the_default_user_is_off(rendered, secret):
    _, docs = rendered
    command = _redis_command(docs)
    users = [command[i + 1 : i + 3] for i, arg in enumerate(command) if arg == "--user"]
    assert ["default", "off"] in users
    assert [secret["stringData"]["redis-username"], "on"] in users
    for doc, container in _onnxforge_workloads(docs):
        url = _container_env(container, docs, secret)["ONNXFORGE_BROKER__URL"]
        assert url.startswith(f"redis://{secret['stringData']['redis-username']}:"), doc["metadata"]["name"]


def _policy_admits(policy: dict[str, Any], namespace: str, pod_labels: dict[str, str]) -> bool:
    for rule in policy["spec"].get("ingress", []):
        for peer in rule.get("from", []):
            if "namespaceSelector" in peer or "ipBlock" in peer:
                continue  # other namespaces: checked separately
            if _labels_match(peer["podSelector"], pod_labels) and namespace == policy["metadata"]["namespace"]:
                return True
    return False


@pytest.mark.parametrize(("target", "port"), [("redis", 6379), ("postgres", 5432)])
def test_network_policy_lets_only_api_workers_and_purge_reach_the_data_stores(rendered, target, port):
    _, docs = rendered
    policies = _by_kind(docs, "NetworkPolicy")
    if target not in _by_kind(docs, "StatefulSet"):
        assert target not in policies
        return
    policy = policies[target]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    selected = {
        d["metadata"]["name"]
        for d in docs
        if _pod_spec(d) is not None
        and _labels_match(policy["spec"]["podSelector"], _pod_template(d)["metadata"]["labels"])
    }
    assert selected == {target}
    admitted = {
        d["metadata"]["name"]
        for d in docs
        if _pod_spec(d) is not None
        and _policy_admits(policy, d["metadata"]["namespace"], _pod_template(d)["metadata"]["labels"])
    }
    workers = {n for n in _by_kind(docs, "Deployment") if n.startswith("worker-")}
    # The retention CronJob reads the job table and never the broker.
    assert admitted == {"api", *workers, *({"purge"} if target == "postgres" else set())}
    for rule in policy["spec"]["ingress"]:
        assert [p["port"] for p in rule["ports"]] == [port]
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            if "namespaceSelector" in peer:  # only the KEDA operator, which reads the queue length
                assert target == "redis"
                assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}
                assert peer["podSelector"] == {"matchLabels": {"app": "keda-operator"}}


def test_services_select_pods_and_name_their_ports(rendered):
    _, docs = rendered
    for service in _by_kind(docs, "Service").values():
        pods = [
            d for d in docs
            if _pod_spec(d) is not None and _labels_match({"matchLabels": service["spec"]["selector"]},
                                                          _pod_template(d)["metadata"]["labels"])
        ]  # fmt: skip
        assert pods, f"Service {service['metadata']['name']} selects no pods"
        names = {p["name"] for d in pods for c in _containers(d) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service {service['metadata']['name']}: {port}"


# -------------------------------------------------------------------------------------------- KEDA


def _priority_lists(queue_key: str) -> list[str]:
    from core.broker import create_celery
    from core.settings import Settings

    redis_broker = Settings(broker={"url": "redis://redis:6379/0"})
    steps = create_celery(redis_broker).conf.broker_transport_options["priority_steps"]
    return [queue_key if p == 0 else f"{queue_key}\x06\x16{p}" for p in steps]


def test_every_worker_deployment_is_scaled_on_its_own_queue_lists(rendered, secret):
    _, docs = rendered
    deployments = _by_kind(docs, "Deployment")
    services = _by_kind(docs, "Service")
    auths = _by_kind(docs, "TriggerAuthentication")
    prefix = _by_kind(docs, "ConfigMap")["onnxforge-settings"]["data"]["ONNXFORGE_BROKER__KEY_PREFIX"]
    scaled = _by_kind(docs, "ScaledObject")
    workers = {n for n in deployments if n.startswith("worker-")}
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == workers
    for so in scaled.values():
        ref = so["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment" and ref.get("apiVersion", "apps/v1") == "apps/v1"
        (container,) = deployments[ref["name"]]["spec"]["template"]["spec"]["containers"]
        queue = _flag(container["args"], "--queues")
        assert "," not in queue, "one queue per worker Deployment, so one list per ScaledObject"
        env = _container_env(container, docs, secret)
        assert env["ONNXFORGE_BROKER__KEY_PREFIX"] == prefix
        triggers = so["spec"]["triggers"]
        # kombu's Redis transport keeps queue Q's waiting messages in the list Q (priority 0) and
        # Q\x06\x16N (priority N), prefixed by global_keyprefix; onnxforge sends priorities 0-9.
        assert [tr["metadata"]["listName"] for tr in triggers] == _priority_lists(f"{prefix}{queue}")
        modifiers = so["spec"]["advanced"]["scalingModifiers"]
        assert modifiers["formula"].replace(" ", "") == "+".join(tr["name"] for tr in triggers), "sum every list"
        assert modifiers["metricType"] == "AverageValue" and int(modifiers["target"]) >= 1
        for trigger in triggers:
            assert trigger["type"] == "redis"
            meta = trigger["metadata"]
            host, port = meta["address"].rsplit(":", 1)
            broker = env["ONNXFORGE_BROKER__URL"]
            broker_host = broker.split("@", 1)[1].split("/", 1)[0]
            assert host == f"{broker_host.split(':')[0]}.{so['metadata']['namespace']}.svc.cluster.local"
            assert int(port) == int(broker_host.split(":")[1]) == services["redis"]["spec"]["ports"][0]["port"]
            assert meta.get("databaseIndex", "0") == broker.rsplit("/", 1)[1]
            assert trigger["authenticationRef"]["name"] in auths
        assert so["spec"]["maxReplicaCount"] >= max(1, so["spec"].get("minReplicaCount", 0))
    # The reconciler (T17) runs inside worker processes: some worker must never scale to zero.
    assert any(so["spec"].get("minReplicaCount", 0) >= 1 for so in scaled.values())


# ---------------------------------------------- the list KEDA watches is the one onnxforge fills (live)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def manifest_redis(tmp_path) -> Iterator[tuple[int, str, str]]:
    """redis-server started with the base manifest's arguments (ACL, AOF, noeviction), on a free local port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: apt-get install redis-server")
    docs = render(K8S / "overlays" / "cpu-only")
    (doc,) = _load_yaml_docs(SECRET_EXAMPLE)
    user, password = doc["stringData"]["redis-username"], uuid.uuid4().hex
    command = [arg.replace("$(REDIS_PASSWORD)", password) for arg in _redis_command(docs)]
    command[command.index("--dir") + 1] = str(tmp_path)
    port = _free_port()
    proc = subprocess.Popen(
        [binary, *command[1:], "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"redis-server with the manifest's arguments did not start: {command}")
                time.sleep(0.05)
        yield port, user, password
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.integration
def test_the_list_keda_watches_holds_the_jobs_onnxforge_enqueues(manifest_redis, tmp_path):
    import redis

    from core.broker import Dispatcher
    from core.settings import Settings

    port, user, password = manifest_redis
    docs = render(K8S / "overlays" / "gpu")
    configmap = _by_kind(docs, "ConfigMap")["onnxforge-settings"]["data"]
    scaled = {so["spec"]["scaleTargetRef"]["name"]: so for so in _by_kind(docs, "ScaledObject").values()}

    anonymous = redis.Redis(port=port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()  # T15: not reachable without AUTH
    anonymous.close()

    env = {k: v for k, v in configmap.items() if k.startswith("ONNXFORGE_")}
    env |= {
        "ONNXFORGE_STORAGE__DATA_DIR": str(tmp_path),
        "ONNXFORGE_BROKER__URL": f"redis://{user}:{password}@127.0.0.1:{port}/0",
        "ONNXFORGE_DATABASE__URL": f"sqlite:///{tmp_path / 'jobs.db'}",
    }
    mp = pytest.MonkeyPatch()
    try:
        for key in [k for k in os.environ if k.startswith("ONNXFORGE_")]:
            mp.delenv(key)
        for key, value in env.items():
            mp.setenv(key, value)
        settings = Settings()
    finally:
        mp.undo()
    with Dispatcher(settings) as dispatcher:
        dispatcher.enqueue(str(uuid.uuid4()), "cpu")
        dispatcher.enqueue(str(uuid.uuid4()), "cpu", priority=4)
        dispatcher.enqueue(str(uuid.uuid4()), "gpu", priority=0)
        dispatcher.enqueue(str(uuid.uuid4()), "gpu", priority=1)
        dispatcher.enqueue(str(uuid.uuid4()), "gpu", priority=9)

    # What the KEDA redis scaler does: LLEN <listName> per trigger, authenticated as the ACL user; then
    # scalingModifiers sums the triggers.
    keda = redis.Redis(port=port, username=user, password=password, db=0)
    try:
        lengths = {
            name: sum(keda.llen(tr["metadata"]["listName"]) for tr in so["spec"]["triggers"])
            for name, so in scaled.items()
        }
        assert lengths == {"worker-cpu": 2, "worker-gpu": 3}
        prefix = configmap["ONNXFORGE_BROKER__KEY_PREFIX"]
        unprefixed = [k for k in keda.scan_iter(match="*") if not k.decode().startswith(prefix)]
        assert not unprefixed, f"keys without the prefix {prefix!r}: {unprefixed}"
    finally:
        keda.close()


# ---------------------------------------------- what the operator chooses, what KEDA owns, what pods get


def test_the_namespace_is_the_overlays_choice_and_no_namespace_object_is_rendered():
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == ["cpu-only", "gpu"]
    assert "namespace" not in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    for directory, extra in OVERLAYS.values():
        docs = render(directory, {**(extra or {}), "namespace": "team-ml"})
        assert not [d for d in docs if d["kind"] == "Namespace"], "kubectl delete -k would delete the claims"
        assert {d["metadata"]["namespace"] for d in docs} == {"team-ml"}
        addresses = {so["spec"]["triggers"][0]["metadata"]["address"] for so in _by_kind(docs, "ScaledObject").values()}
        assert addresses == {"redis.team-ml.svc.cluster.local:6379"}


def test_the_shared_volumes_storage_class_is_the_overlays_choice(rendered):
    _, docs = rendered
    (base_claim,) = _by_kind(render(K8S / "base"), "PersistentVolumeClaim").values()
    assert "storageClassName" not in base_claim["spec"]
    (claim,) = _by_kind(docs, "PersistentVolumeClaim").values()
    assert claim["spec"]["storageClassName"], "an overlay names the ReadWriteMany class"


def test_autoscaled_deployments_leave_the_replica_count_to_keda(rendered):
    _, docs = rendered
    deployments = _by_kind(docs, "Deployment")
    targets = {so["spec"]["scaleTargetRef"]["name"] for so in _by_kind(docs, "ScaledObject").values()}
    assert targets
    for name in targets:
        # Every apply would reset KEDA's count, draining busy workers or starting idle GPU pods.
        assert "replicas" not in deployments[name]["spec"], f"{name} sets replicas although KEDA scales it"


def test_workers_request_whole_cpus_equal_to_limits_and_size_ort_threads_from_the_limit(rendered, secret):
    _, docs = rendered
    workers = [(d, c) for d, c in _onnxforge_workloads(docs) if c["args"][0] == "worker"]
    assert workers
    for doc, container in workers:
        name, resources = doc["metadata"]["name"], container["resources"]
        assert resources["requests"] == resources["limits"], f"{name}: requests differ from limits"
        cpus = _cpu_quantity(resources["limits"]["cpu"])
        assert cpus >= 1 and cpus == int(cpus), f"{name}: {cpus} CPUs is not a whole number"
        (threads,) = [v for v in container["env"] if v["name"] == "ONNXFORGE_PIPELINE__INTRA_OP_THREADS"]
        assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu", name
        assert _container_env(container, docs, secret)["ONNXFORGE_PIPELINE__INTRA_OP_THREADS"] == str(int(cpus))


def test_downward_api_threads_follow_a_changed_cpu_limit(rendered, secret):
    _, docs = rendered
    doc = copy.deepcopy(_by_kind(docs, "Deployment")["worker-cpu"])
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    container["resources"]["limits"]["cpu"] = "2500m"
    assert _container_env(container, docs, secret)["ONNXFORGE_PIPELINE__INTRA_OP_THREADS"] == "3"


def test_onnxforge_images_are_tagged_with_the_project_version(rendered):
    _, docs = rendered
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for doc, container in _onnxforge_workloads(docs):
        _, tag, _ = _split_image(container["image"])
        assert tag == version, f"{doc['metadata']['name']} runs {container['image']}, not version {version}"


@pytest.mark.parametrize("overlay", ["cpu-only", "gpu"])
def test_renderer_agrees_with_kubectl_kustomize(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the renderer is compared with kustomize where it is")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    theirs = {_ident(d): d for d in yaml.safe_load_all(result.stdout) if d}
    ours = {_ident(d): d for d in render(K8S / "overlays" / overlay)}
    assert sorted(ours) == sorted(theirs)
    for key, doc in ours.items():
        assert doc == theirs[key], f"{key} differs from kustomize's rendering"


# ------------------------------------------------- readiness: the probe the manifest names, on a live API


@pytest.mark.integration
def test_api_stays_ready_on_the_manifests_probe_while_the_broker_is_down(services, tmp_path):
    import httpx

    from tests.conftest import free_port, service_env

    docs = render(K8S / "overlays" / "cpu-only")
    (api,) = _by_kind(docs, "Deployment")["api"]["spec"]["template"]["spec"]["containers"]
    probe = api["readinessProbe"]["httpGet"]["path"]
    dead_broker = f"redis://127.0.0.1:{free_port()}/0"
    env = service_env(tmp_path / "data", broker_url=dead_broker, broker__connect_timeout=0.5)
    service = services.serve(env, embedded=False)

    strict = httpx.get(f"{service.url}/readyz", timeout=10)
    assert strict.status_code == 503 and "broker" in strict.text
    ready = httpx.get(f"{service.url}{probe}", timeout=10)
    assert ready.status_code == 200, ready.text
    checks = ready.json()["checks"]
    assert checks["database"] == "ok" and checks["storage"] == "ok" and checks["broker"] != "ok"
    assert httpx.get(f"{service.url}/v1/jobs", timeout=10).status_code == 200  # a read path, served


def test_workers_unpack_jobs_on_local_disk_not_on_the_shared_volume(rendered, secret):
    _, docs = rendered
    for doc, container in [(d, c) for d, c in _onnxforge_workloads(docs) if c["args"][0] == "worker"]:
        scratch = _container_env(container, docs, secret)["ONNXFORGE_STORAGE__SCRATCH_DIR"]
        volumes = {v["name"]: v for v in _pod_spec(doc)["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == scratch]
        assert "emptyDir" in volumes[mount["name"]], f"{doc['metadata']['name']}: scratch is not node-local"
        assert volumes[mount["name"]]["emptyDir"].get("sizeLimit"), "an unbounded emptyDir can fill the node"


# ------------------------------------------------------------------------- schema migrations, retention


def test_services_migrate_in_an_init_container_and_do_not_migrate_themselves(rendered, secret):
    _, docs = rendered
    services = [d for d in docs if d["kind"] == "Deployment" and any(_is_onnxforge(c) for c in _containers(d))]
    assert {d["metadata"]["name"] for d in services} >= {"api", "worker-cpu"}
    for doc in services:
        name, spec = doc["metadata"]["name"], _pod_spec(doc)
        (init,) = spec.get("initContainers", [{}])
        assert init.get("args") == ["migrate"], f"{name}: no `onnxforge migrate` before the service starts"
        (main,) = spec["containers"]
        assert init["image"] == main["image"], f"{name}: migrates to another version's schema than it runs"
        for container in (init, main):
            env = _container_env(container, docs, secret)
            assert env["ONNXFORGE_DATABASE__AUTO_MIGRATE"] == "false", f"{name}/{container['name']}"
        assert _container_env(init, docs, secret)["ONNXFORGE_DATABASE__URL"] == env["ONNXFORGE_DATABASE__URL"]
        if main["args"][0] == "worker":  # a Guaranteed pod needs every container's requests equal to its limits
            assert init["resources"]["requests"] == init["resources"]["limits"], name


def test_purge_runs_daily_one_run_at_a_time_on_the_shared_store(rendered, secret):
    _, docs = rendered
    cron = _by_kind(docs, "CronJob")["purge"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    minute, hour, *rest = cron["spec"]["schedule"].split()
    assert minute.isdigit() and hour.isdigit() and rest == ["*", "*", "*"], "not once a day"
    spec = _pod_spec(cron)
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["args"][:2] == ["purge", "--sweep"]
    api = _by_kind(docs, "Deployment")["api"]
    (api_container,) = _pod_spec(api)["containers"]
    assert container["image"] == api_container["image"]
    purge_env, api_env = _container_env(container, docs, secret), _container_env(api_container, docs, secret)
    for key in ("ONNXFORGE_DATABASE__URL", "ONNXFORGE_STORAGE__DATA_DIR"):
        assert purge_env[key] == api_env[key], f"purge and the API disagree on {key}"
