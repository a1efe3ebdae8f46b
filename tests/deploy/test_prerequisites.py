"""What a real cluster must have for the manifests, checked offline (docs/deploy.md, "Prerequisites"):

- the ServiceMonitor needs the Prometheus Operator's CRD: it comes from one component, and an overlay without that
  component renders nothing but built-in kinds (each object validates against the plain Kubernetes schema);
- Pod Security Admission: every overlay's namespace enforces exactly the level its pods need (tests/deploy/
  pod_security.py computes it), privileged for the same-host path, restricted for overlays/restricted;
- the NetworkPolicy admits the metrics port from Prometheus's namespace only, in a policy of its own that the patch
  docs/deploy.md shows moves to another namespace without touching the engines' rules."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize import (DEPLOY, KUBECTL, KUBERNETES_VERSION, OVERLAYS, WORKLOADS, edited_overlay, one,
                                    render, render_overlay)
from tests.deploy.pod_security import level_needed, loosest, violations
from tests.helpers import ROOT

DOCS = (ROOT / "docs" / "deploy.md").read_text()
SERVICEMONITOR = "../../components/servicemonitor"
PSA_LABEL = "pod-security.kubernetes.io/enforce"
NEEDED_LEVEL = {"cpu": "privileged", "gpu": "privileged", "redis-cluster": "privileged", "restricted": "restricted"}
PROMETHEUS_NAMESPACE = "monitoring"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed")


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render_overlay(request.param)


# -- the ServiceMonitor and the Prometheus Operator ----------------------------------------------------------------

def _without_servicemonitor(kustomization: dict) -> None:
    """The edit docs/deploy.md tells a cluster without the Prometheus Operator to make: delete one line."""
    kustomization["components"] = [c for c in kustomization["components"] if not c.endswith("/servicemonitor")]


def test_every_overlay_has_the_servicemonitor_from_its_component(rendered):
    overlay, objects = rendered
    kustomization = yaml.safe_load((DEPLOY / "overlays" / overlay / "kustomization.yaml").read_text())
    assert SERVICEMONITOR in kustomization["components"]
    assert one(objects, "ServiceMonitor", "tiercache")["metadata"]["namespace"] == "tiercache"
    assert not (DEPLOY / "base" / "servicemonitor.yaml").exists(), "the base must apply without the operator"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_without_the_servicemonitor_component_an_overlay_needs_no_crd(overlay, tmp_path):
    shipped = render_overlay(overlay)
    objects = render(edited_overlay(overlay, tmp_path, _without_servicemonitor))
    assert [o for o in objects if o["kind"] == "ServiceMonitor"] == []
    for obj in objects:  # only kinds every cluster has: the schema of Kubernetes itself knows each of them
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    assert [o for o in shipped if o["kind"] != "ServiceMonitor"] == objects, "only the ServiceMonitor goes"
    assert f"`- {SERVICEMONITOR}`" in DOCS, "docs/deploy.md names the line to delete"


# -- Pod Security Admission ----------------------------------------------------------------------------------------

def _pods(objects: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
            for o in objects if o["kind"] in WORKLOADS}


def test_the_namespace_enforces_the_level_its_pods_need(rendered):
    overlay, objects = rendered
    needed = {name: level_needed(pod) for name, pod in _pods(objects).items()}
    namespace = one(objects, "Namespace")["metadata"]
    assert loosest(list(needed.values())) == NEEDED_LEVEL[overlay], needed
    assert namespace["labels"][PSA_LABEL] == NEEDED_LEVEL[overlay], "stricter rejects the pods, looser is lax"
    # Only the server needs more than restricted: Redis and the Job that forms a cluster run under any level.
    assert {level for name, level in needed.items() if name != "DaemonSet/tiercache"} <= {"restricted"}
    assert f"`deploy/overlays/{overlay}`" in DOCS


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "restricted"])
def test_the_restricted_component_fits_every_overlay(overlay, tmp_path):
    """docs/deploy.md offers components/restricted for any overlay: with it, every pod passes restricted."""
    def add_restricted(kustomization: dict) -> None:
        kustomization["components"].append("../../components/restricted")
    objects = render(edited_overlay(overlay, tmp_path, add_restricted))
    assert {name: level_needed(pod) for name, pod in _pods(objects).items()} == \
        {name: "restricted" for name in _pods(objects)}
    assert one(objects, "Namespace")["metadata"]["labels"][PSA_LABEL] == "restricted"


def test_the_same_host_path_is_what_needs_privileged():
    """The base's server breaks baseline by hostIPC and its hostPath volumes only, and restricted by its root init
    container (base/namespace.yaml and docs/deploy.md say so); anything else would be news to document."""
    pod = _pods(render_overlay("cpu"))["DaemonSet/tiercache"]
    assert {(v.level, v.rule, v.where) for v in violations(pod)} == {
        ("baseline", "hostIPC", "pod"),
        ("baseline", "hostPath", "volume disk-tier"), ("baseline", "hostPath", "volume sockets"),
        ("restricted", "volumeTypes", "volume disk-tier"), ("restricted", "volumeTypes", "volume sockets"),
        ("restricted", "runAsNonRoot", "container own-host-dirs"),
        ("restricted", "runAsUser", "container own-host-dirs"),
        ("restricted", "capabilities", "container own-host-dirs")}


def _set(path: str, value):
    """A change to a pod spec: the field at the dotted path (list items by index) set, or deleted with None."""
    def change(pod: dict) -> None:
        *parents, last = path.split(".")
        target = pod
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target.setdefault(key, {})
        if value is None:
            del target[last]
        else:
            target[last] = value
    return change


@pytest.mark.parametrize("change, level", [
    (_set("hostIPC", True), "privileged"),
    (_set("hostPID", True), "privileged"),
    (_set("hostNetwork", True), "privileged"),
    (lambda pod: pod["volumes"].append({"name": "h", "hostPath": {"path": "/x"}}), "privileged"),
    (_set("containers.0.securityContext.privileged", True), "privileged"),
    (_set("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]), "privileged"),
    (_set("containers.0.ports.0.hostPort", 50051), "privileged"),
    (_set("securityContext.seccompProfile", {"type": "Unconfined"}), "privileged"),
    (_set("containers.0.securityContext.capabilities.add", ["CHOWN"]), "baseline"),
    (_set("containers.0.securityContext.capabilities.drop", []), "baseline"),
    (_set("containers.0.securityContext.allowPrivilegeEscalation", True), "baseline"),
    (_set("containers.0.securityContext.runAsNonRoot", False), "baseline"),
    (_set("securityContext.runAsNonRoot", None), "baseline"),
    (_set("containers.0.securityContext.runAsUser", 0), "baseline"),
    (_set("securityContext.seccompProfile", None), "baseline"),
    (lambda pod: pod["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}), "baseline"),
])
def test_the_level_checker_catches_each_rule(change, level):
    """Each rule of tests/deploy/pod_security.py, broken one at a time on the restricted overlay's server."""
    pod = _pods(render_overlay("restricted"))["DaemonSet/tiercache"]
    assert level_needed(pod) == "restricted", violations(pod)
    change(pod)
    assert level_needed(pod) == level, violations(pod)


# -- the NetworkPolicy and Prometheus's namespace ------------------------------------------------------------------

def _admitting(objects: list[dict], port: str) -> list[dict]:
    """The NetworkPolicies that admit `port` on the server's pods, with the rules that do."""
    found = []
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"
                   and o["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "tiercache"):
        rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r.get("ports", []))]
        if rules:
            found.append({"name": policy["metadata"]["name"], "rules": rules})
    return found


def _metrics_from(objects: list[dict]) -> list[dict]:
    (policy,) = _admitting(objects, "metrics")
    assert policy["name"] == "tiercache-metrics"
    (rule,) = policy["rules"]
    assert [p["port"] for p in rule["ports"]] == ["metrics"], "the metrics policy opens nothing else"
    return rule["from"]


def test_metrics_are_admitted_from_the_prometheus_namespace_only(rendered):
    _, objects = rendered
    assert _metrics_from(objects) == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": PROMETHEUS_NAMESPACE}}}]
    assert f"kubernetes.io/metadata.name: {PROMETHEUS_NAMESPACE}" in DOCS


def _documented_metrics_patch() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS, re.S)
    (patch,) = [b for b in blocks if "name: tiercache-metrics" in b]
    return patch


def test_the_documented_patch_moves_the_metrics_rule_and_nothing_else(tmp_path):
    patch = _documented_metrics_patch()
    namespace = yaml.safe_load(patch)["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"][
        "kubernetes.io/metadata.name"]
    assert namespace != PROMETHEUS_NAMESPACE

    def add_patch(kustomization: dict) -> None:
        kustomization.setdefault("patches", []).append({"path": "metrics-from.yaml"})
    copy = edited_overlay("cpu", tmp_path, add_patch)
    (copy / "metrics-from.yaml").write_text(patch)
    shipped, patched = render_overlay("cpu"), render(copy)
    assert _metrics_from(patched) == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}]
    assert [o for o in patched if o["metadata"]["name"] != "tiercache-metrics"] == \
        [o for o in shipped if o["metadata"]["name"] != "tiercache-metrics"]
