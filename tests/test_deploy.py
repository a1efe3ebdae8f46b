"""The Kubernetes manifests and the Dockerfile, checked offline: every overlay renders with kustomize, every object
validates against the Kubernetes schema, and what the manifests say agrees with what `tiercache serve` accepts
(flags, config keys, ports, probes, mounted paths, memory sized from the tier capacities)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tiercache.cli import build_parser, config_from_args
from tiercache.config import Config, GiB, parse_size
from tiercache.protocol.wire import SERVICE_NAME

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ("cpu", "gpu", "redis-cluster")
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests promise to work on (native gRPC probes are GA in 1.27)
NO_SCHEMA = {"ServiceMonitor"}  # CRD of the Prometheus Operator: checked by the consistency tests below instead
SERVER_OVERHEAD = 1 * GiB  # the DaemonSet's memory request beyond the host tier
REDIS_OVERHEAD = 2 * GiB

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")


def _render(overlay: str) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(ROOT / "deploy" / "overlays" / overlay)], check=True,
                         capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


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
    policy = _one(objects, "NetworkPolicy", "tiercache")
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == set(ports)


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


def test_memory_request_is_the_host_tier_plus_overhead(rendered, tmp_path):
    _, objects = rendered
    config = _server_config(objects, tmp_path)
    resources = _server_container(objects)["resources"]
    request = parse_size(resources["requests"]["memory"])
    assert request == config.host.capacity_bytes + SERVER_OVERHEAD
    assert parse_size(resources["limits"]["memory"]) >= request
    assert _one(objects, "DaemonSet", "tiercache")["spec"]["template"]["spec"]["hostIPC"] is True


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
    # The image's CMD serves the embedded defaults (tests/test_image.py); the DaemonSet replaces it with its config.
    assert _server_container(objects)["args"][:2] == ["--config", "/etc/tiercache/tiercache.yaml"]
    assert _mounted(pod["containers"][0], "/etc/tiercache/tiercache.yaml")
