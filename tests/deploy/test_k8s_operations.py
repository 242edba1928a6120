"""deploy/k8s, operated: Redis and the NetworkPolicies around the data stores, what KEDA watches (checked
live against a redis-server started with the manifest's own arguments), what the operator chooses and what
KEDA owns, readiness without the broker on a live API, migrations and retention."""

from __future__ import annotations

import copy
import os
import shutil
import socket
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.deploy._k8s import (
    OVERLAYS,
    _by_kind,
    _container_env,
    _cpu_quantity,
    _flag,
    _is_onnxforge,
    _labels_match,
    _onnxforge_workloads,
)
from tests.deploy._kustomize import (
    K8S,
    ROOT,
    SECRET_EXAMPLE,
    _containers,
    _ident,
    _load_yaml_docs,
    _pod_spec,
    _pod_template,
    _split_image,
    render,
)

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
