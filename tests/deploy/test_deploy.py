"""The Kubernetes manifests and the Dockerfile, checked offline: every overlay renders with kustomize, every object
validates against the Kubernetes schema, and what the manifests say agrees with what `tiercache serve` accepts
(flags, config keys, ports, probes, mounted paths, memory sized from the tier capacities), every namespaced object
lands in the one namespace, and every name a pod refers to (Services, Secrets, ConfigMaps) is there."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.kustomize import KUBECTL, KUBERNETES_VERSION, OVERLAYS, WORKLOADS
from tests.deploy.kustomize import one as _one
from tests.deploy.kustomize import render_overlay as _render
from tests.helpers import ROOT
from tiercache.cli import build_parser, config_from_args
from tiercache.config import Config, GiB, parse_size
from tiercache.protocol.wire import SERVICE_NAME

NO_SCHEMA = {"ServiceMonitor"}  # CRD of the Prometheus Operator: checked by the consistency tests below instead
SERVER_OVERHEAD = 1 * GiB  # the DaemonSet's memory request beyond the host tier
REDIS_OVERHEAD = 2 * GiB
# Kinds without a namespace; every other object must land in the Namespace the base creates.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                  "PriorityClass", "StorageClass"}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


def _server_container(objects: list[dict]) -> dict:
    return _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]["containers"][0]


def _server_config(objects: list[dict], tmp_path: Path) -> Config:
    """Parse the DaemonSet's args exactly as `tiercache serve` would, with the rendered ConfigMap as --config."""
    container = _server_container(objects)
    config_file = tmp_path / "tiercache.yaml"
    config_map = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(
        "tiercache-config"))
    config_file.write_text(config_map["data"]["tiercache.yaml"])
    args = [str(config_file) if a == "/etc/tiercache/tiercache.yaml" else a for a in container["args"]]
    assert "serve" not in args, "the image's entrypoint is `tiercache serve`; args carry flags only"
    return config_from_args(build_parser().parse_args(["serve", *args]))


def test_every_object_validates_against_the_kubernetes_schema(rendered):
    overlay, objects = rendered
    for obj in objects:
        if obj["kind"] in NO_SCHEMA:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc}")


def test_args_and_config_are_what_tiercache_serve_accepts(rendered, tmp_path):
    overlay, objects = rendered
    config = _server_config(objects, tmp_path)
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert config.security.tls and config.security.tenants_file and config.security.health_port is not None
    assert config.redis.url and config.redis.write_through and config.redis.password_file
    assert config.redis.cluster == (overlay == "redis-cluster")
    assert (config.gpu.capacity_bytes > 0) == (overlay == "gpu")


def test_ports_and_probes_match_the_server(rendered, tmp_path):
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    container = _server_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.server.port, "health": config.security.health_port,
                     "metrics": config.server.metrics_port, "data": config.server.data_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == config.security.health_port, probe
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    service = _one(objects, "Service", "tiercache")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    monitor = _one(objects, "ServiceMonitor", "tiercache")
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # Policies add up (the metrics port has one of its own: tests/deploy/test_prerequisites.py): together they open
    # every port the server listens on, and nothing else.
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"
                and o["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "tiercache"}]
    assert {p["port"] for policy in policies for rule in policy["spec"]["ingress"] for p in rule["ports"]} == set(ports)


def _mounted(container: dict, path: str) -> dict | None:
    return next((m for m in container["volumeMounts"]
                 if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")), None)


def test_every_file_the_config_names_is_mounted(rendered, tmp_path):
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    pod = _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
    secrets = {s["metadata"]["name"] for s in objects if s["kind"] == "Secret"}
    paths = [config.security.tls_cert_file, config.security.tls_key_file, config.security.tenants_file,
             config.redis.password_file, config.disk.path, config.server.unix_socket,
             *(e["value"] for e in container["env"] if e["name"].endswith("_FILE"))]
    for path in paths:
        mount = _mounted(container, path)
        assert mount is not None, f"{path} is in no volume"
        volume = volumes[mount["name"]]
        if "secret" in volume:  # secrets are created by the operator (docs/deploy.md), never shipped
            assert volume["secret"]["secretName"] not in secrets
            items = volume["secret"].get("items")
            assert items is None or Path(path).name in {i["path"] for i in items}
    assert _mounted(container, config.disk.path)["name"] != "tmp", "the disk tier must outlive the pod"


def _namespace(objects: list[dict]) -> str:
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert len(namespaces) == 1, f"expected one Namespace, found {namespaces}"
    return namespaces[0]


def test_every_namespaced_object_lands_in_the_one_namespace(rendered):
    # Objects the redis components added had no namespace: `kubectl apply -k` put Redis in the current context's
    # namespace, away from its Secret and from the servers' DNS name for it.
    overlay, objects = rendered
    namespace = _namespace(objects)
    stray = [f"{o['kind']}/{o['metadata']['name']} in {o['metadata'].get('namespace')!r}" for o in objects
             if o["kind"] not in CLUSTER_SCOPED and o["metadata"].get("namespace") != namespace]
    assert stray == [], f"{overlay}: not in namespace {namespace!r}: {stray}"


def _documented_secrets() -> dict[tuple[str, str], set[str]]:
    """(namespace, name) -> keys of every Secret docs/deploy.md tells the operator to create (they are never shipped).
    Optional flags in [brackets] count: the overlay that needs them says so."""
    text = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")
    secrets = {}
    for line in text.splitlines():
        if "create secret generic" not in line:
            continue
        words = shlex.split(line.replace("[", " ").replace("]", " "))
        name = words[words.index("generic") + 1]
        namespace = words[words.index("-n") + 1]
        keys = set()
        for word in words:
            if word.startswith(("--from-file=", "--from-literal=")):
                value = word.split("=", 1)[1]
                keys.add(value.split("=", 1)[0] if "=" in value else Path(value).name)
        secrets[(namespace, name)] = keys
    return secrets


def _referenced(pod: dict) -> list[tuple[str, str, set[str]]]:
    """(kind, name, keys used) of every ServiceAccount, ConfigMap and Secret a pod spec refers to."""
    found = [("ServiceAccount", pod["serviceAccountName"], set())] if "serviceAccountName" in pod else []
    for volume in pod.get("volumes", []):
        for kind, field, name_field in (("Secret", "secret", "secretName"), ("ConfigMap", "configMap", "name")):
            if field in volume:
                found.append((kind, volume[field][name_field], {i["key"] for i in volume[field].get("items", [])}))
    for container in pod.get("initContainers", []) + pod["containers"]:
        for env in container.get("env", []):
            ref = env.get("valueFrom", {})
            if "secretKeyRef" in ref:
                found.append(("Secret", ref["secretKeyRef"]["name"], {ref["secretKeyRef"]["key"]}))
            if "configMapKeyRef" in ref:
                found.append(("ConfigMap", ref["configMapKeyRef"]["name"], set()))
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                found.append(("Secret", source["secretRef"]["name"], set()))
            if "configMapRef" in source:
                found.append(("ConfigMap", source["configMapRef"]["name"], set()))
    return found


def _service_host_resolves(host: str, namespace: str, objects: list[dict]) -> bool:
    """Whether a DNS name, as a pod in `namespace` resolves it, names a Service there: `service`, or
    `<statefulset>-<i>.<headless service>` (a StatefulSet pod), either one optionally followed by `.<namespace>...`."""
    services = {o["metadata"]["name"]: o for o in objects
                if o["kind"] == "Service" and o["metadata"].get("namespace") == namespace}
    parts = host.split(".")
    if parts[0] in services:
        return parts[1:2] in ([], [namespace])
    if len(parts) < 2 or parts[1] not in services or parts[2:3] not in ([], [namespace]):
        return False
    if services[parts[1]]["spec"].get("clusterIP") != "None":
        return False  # only a headless Service gives each pod a name
    return any(parts[0] == f"{o['metadata']['name']}-{i}" for o in objects
               if o["kind"] == "StatefulSet" and o["metadata"].get("namespace") == namespace
               and o["spec"]["serviceName"] == parts[1] for i in range(o["spec"].get("replicas", 1)))


def test_every_name_the_pods_and_the_server_refer_to_exists_in_their_namespace(rendered, tmp_path):
    overlay, objects = rendered
    present = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects}
    documented = _documented_secrets()
    missing = []
    for owner in (o for o in objects if o["kind"] in WORKLOADS):
        namespace, pod = owner["metadata"].get("namespace"), owner["spec"]["template"]["spec"]
        where = f"{owner['kind']}/{owner['metadata']['name']}"
        for kind, name, keys in _referenced(pod):
            if kind == "Secret":  # created by the operator per docs/deploy.md, in the pod's namespace
                if (namespace, name) not in documented or not keys <= documented[(namespace, name)]:
                    missing.append(f"{where}: Secret {namespace}/{name} (keys {sorted(keys)}) is not created by "
                                   f"docs/deploy.md")
            elif (kind, namespace, name) not in present:
                missing.append(f"{where}: {kind} {namespace}/{name}")
        if owner["kind"] == "StatefulSet" and ("Service", namespace, owner["spec"]["serviceName"]) not in present:
            missing.append(f"{where}: Service {namespace}/{owner['spec']['serviceName']}")
    assert missing == [], f"{overlay}: {missing}"
    config = _server_config(objects, tmp_path)
    namespace = _one(objects, "DaemonSet", "tiercache")["metadata"]["namespace"]
    host = re.match(r"rediss?://(?:[^@/]*@)?([^:/]+)", config.redis.url).group(1)
    assert _service_host_resolves(host, namespace, objects), f"{overlay}: {host} names no Service in {namespace}"


def test_the_checks_above_catch_what_they_guard(tmp_path):
    """The namespace and reference checks fail on the manifests as they once were (the Redis component's objects
    without a namespace) and on a Redis URL that names nothing."""
    objects = _render("cpu")
    redis = [o for o in objects if o["metadata"]["name"].startswith("tiercache-redis")]
    for obj in redis:
        del obj["metadata"]["namespace"]
    with pytest.raises(AssertionError, match="not in namespace"):
        test_every_namespaced_object_lands_in_the_one_namespace(("cpu", objects))
    assert not _service_host_resolves("tiercache-redis-0.tiercache-redis", "tiercache", objects)
    objects = _render("cpu")
    assert _service_host_resolves("tiercache-redis-0.tiercache-redis", "tiercache", objects)
    assert _service_host_resolves("tiercache-redis-0.tiercache-redis.tiercache.svc.cluster.local", "tiercache",
                                  objects)
    for wrong in ("tiercache-redis-1.tiercache-redis", "tiercache-redis-0.tiercache-redis.default",
                  "tiercache-redis-0.tiercache", "redis"):
        assert not _service_host_resolves(wrong, "tiercache", objects), wrong
    assert ("tiercache", "tiercache-redis") in _documented_secrets()


def test_memory_request_is_the_host_tier_plus_overhead(rendered, tmp_path):
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    resources = _server_container(objects)["resources"]
    request = parse_size(resources["requests"]["memory"])
    assert request == config.host.capacity_bytes + SERVER_OVERHEAD
    assert parse_size(resources["limits"]["memory"]) >= request
    # The host tier's /dev/shm: the node's (hostIPC, for same-host copies), or the pod's own memory-backed emptyDir
    # that holds the whole tier (overlays/restricted); the runtime's default of 64 MB would not.
    pod = _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]
    assert config.host.shared_memory
    if not pod.get("hostIPC"):
        shm = {v["name"]: v for v in pod["volumes"]}[_mounted(_server_container(objects), "/dev/shm")["name"]]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert parse_size(shm["emptyDir"]["sizeLimit"]) >= config.host.capacity_bytes


def test_ephemeral_storage_request_holds_the_pods_disk_volumes(rendered, tmp_path):
    """An emptyDir on disk is charged to the pod's ephemeral storage (a hostPath is not): the request holds all of
    them, and the disk tier's volume its capacity, or the kubelet evicts the pod as the tier fills."""
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    pod = _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    on_disk = {v["name"]: parse_size(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]
               if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}
    assert parse_size(container["resources"]["requests"]["ephemeral-storage"]) >= sum(on_disk.values())
    disk_volume = _mounted(container, config.disk.path)["name"]
    if disk_volume in on_disk:
        assert on_disk[disk_volume] >= config.disk.capacity_bytes


def test_redis_is_the_service_the_server_points_at_and_is_sized_from_maxmemory(rendered, tmp_path):
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    host = re.match(r"rediss?://([^:/]+)", config.redis.url).group(1)
    pod_name, service_name = host.split(".", 1)
    statefulset = _one(objects, "StatefulSet")
    assert statefulset["spec"]["serviceName"] == service_name
    assert pod_name.startswith(statefulset["metadata"]["name"] + "-")
    assert _one(objects, "Service", service_name)["spec"]["clusterIP"] == "None"
    conf_map = next(o for o in objects if o["kind"] == "ConfigMap" and "redis.conf" in o.get("data", {}))
    conf = dict(line.split(None, 1) for line in conf_map["data"]["redis.conf"].splitlines()
                if line.strip() and not line.startswith("#"))
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    request = parse_size(container["resources"]["requests"]["memory"])
    assert request == _redis_bytes(conf["maxmemory"]) + REDIS_OVERHEAD
    assert conf["maxmemory-policy"] == "allkeys-lru"
    assert {"name": "MALLOC_CONF", "value": "dirty_decay_ms:-1,muzzy_decay_ms:-1"} in container["env"]
    assert ("cluster-enabled" in conf) == config.redis.cluster


def _redis_bytes(text: str) -> int:
    """Redis reads '8gb' as 8 GiB (its units are powers of 1024 despite the spelling)."""
    number, unit = re.match(r"(\d+)([a-z]*)", text.lower()).groups()
    return int(number) * {"": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}[unit]


def test_dockerfile_lints_clean_and_matches_the_manifests(tmp_path):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tiercache", "serve"]' in dockerfile
    assert "scripts/install.sh" in dockerfile  # the same install steps CI runs
    assert re.search(r"^USER 10001", dockerfile, re.M)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()}
    objects = _render("cpu")
    assert exposed == {p["containerPort"] for p in _server_container(objects)["ports"]}
    pod = _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001
    # The image's CMD serves the embedded defaults (tests/deploy/test_image.py); the DaemonSet replaces it with its
    # config.
    assert _server_container(objects)["args"][:2] == ["--config", "/etc/tiercache/tiercache.yaml"]
    assert _mounted(pod["containers"][0], "/etc/tiercache/tiercache.yaml")
