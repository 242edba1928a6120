"""A small pure-Python renderer for the subset of kustomize the manifests use (resources, components,
namespace, images, patches with strategic merge and ``$patch: delete``, replacements). A key it does not
know fails, so the manifests cannot drift beyond what the tests check."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

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
