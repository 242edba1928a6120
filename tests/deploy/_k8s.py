"""What the k8s tests share: the overlays, and lookups into rendered objects."""

from __future__ import annotations

import math
import re
from typing import Any

from tests.deploy._kustomize import K8S, _containers, _split_image

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
