"""Which Pod Security Standards level a pod spec needs: the checks of Pod Security Admission that a tiercache manifest
can trip, written from the standard (kubernetes.io/docs/concepts/security/pod-security-standards) so that the tests
can tell offline what a namespace must enforce.

- baseline forbids: host namespaces (hostNetwork, hostPID, hostIPC), hostPath volumes, privileged containers,
  capabilities added beyond the runtime's default set, host ports, and a seccomp profile of Unconfined;
- restricted forbids all that and also: volumes other than the listed kinds, privilege escalation not turned off,
  containers that may run as root (runAsNonRoot not true, or runAsUser 0), a seccomp profile other than
  RuntimeDefault or Localhost, and capabilities other than NET_BIND_SERVICE (every container drops ALL).

Not modelled, as no manifest here sets them: AppArmor, SELinux options, procMount, sysctls, Windows host processes.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

LEVELS = ("privileged", "baseline", "restricted")  # loosest first
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


class Violation(NamedTuple):
    level: str  # the strictest level it breaks: the pod can run only under a looser one
    rule: str  # the standard's control, e.g. "hostIPC", "runAsNonRoot"
    where: str  # "pod", "volume disk-tier", "container own-host-dirs"


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"] + pod.get("ephemeralContainers", [])


def _baseline(pod: dict) -> Iterator[Violation]:
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            yield Violation("baseline", field, "pod")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            yield Violation("baseline", "hostPath", f"volume {volume['name']}")
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        yield Violation("baseline", "seccompProfile", "pod")
    for container in _containers(pod):
        where, context = f"container {container['name']}", container.get("securityContext", {})
        if context.get("privileged"):
            yield Violation("baseline", "privileged", where)
        if set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            yield Violation("baseline", "capabilities", where)
        if any(port.get("hostPort") for port in container.get("ports", [])):
            yield Violation("baseline", "hostPort", where)
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            yield Violation("baseline", "seccompProfile", where)


def _restricted(pod: dict) -> Iterator[Violation]:
    for volume in pod.get("volumes", []):
        if not set(volume) - {"name"} <= RESTRICTED_VOLUMES:
            yield Violation("restricted", "volumeTypes", f"volume {volume['name']}")
    pod_context = pod.get("securityContext", {})
    if pod_context.get("runAsUser") == 0:
        yield Violation("restricted", "runAsUser", "pod")
    for container in _containers(pod):
        where, context = f"container {container['name']}", container.get("securityContext", {})
        if context.get("allowPrivilegeEscalation") is not False:
            yield Violation("restricted", "allowPrivilegeEscalation", where)
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            yield Violation("restricted", "runAsNonRoot", where)
        if context.get("runAsUser") == 0:
            yield Violation("restricted", "runAsUser", where)
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield Violation("restricted", "seccompProfile", where)
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            yield Violation("restricted", "capabilities", where)


def violations(pod: dict) -> list[Violation]:
    """Every check of either level that the pod spec fails."""
    return [*_baseline(pod), *_restricted(pod)]


def level_needed(pod: dict) -> str:
    """The strictest level under which Pod Security Admission admits the pod."""
    broken = {v.level for v in violations(pod)}
    return "privileged" if "baseline" in broken else "baseline" if "restricted" in broken else "restricted"


def loosest(levels: list[str]) -> str:
    """The level a namespace must enforce for all of these pods: the loosest any of them needs."""
    return min(levels, key=LEVELS.index)
