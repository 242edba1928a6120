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
from typing import Any

import pytest

from tests.deploy._cli import assert_cli_accepts, assert_settings_accept_env
from tests.deploy._k8s import (
    OVERLAYS,
    READINESS_PATH,
    _by_kind,
    _container_env,
    _flag,
    _is_onnxforge,
    _onnxforge_workloads,
)
from tests.deploy._kustomize import (
    CLUSTER_SCOPED,
    CUSTOM_SCHEMAS,
    K8S,
    OLDEST_K8S,
    SCHEMAS,
    KustomizeError,
    _containers,
    _pod_spec,
    _split_image,
    render,
)

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
