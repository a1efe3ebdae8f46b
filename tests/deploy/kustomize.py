"""Rendering the overlays with `kubectl kustomize`, as shipped or edited the way docs/deploy.md tells a user to edit
them (in a copy under the test's tmp dir: the checkout is never written)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import yaml

from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "redis-cluster", "restricted")
KUBECTL = shutil.which("kubectl")
KUBERNETES_VERSION = "1.30"  # the oldest release the manifests promise to work on (native gRPC probes are GA in 1.27)
WORKLOADS = {"DaemonSet", "Deployment", "StatefulSet", "Job"}


def render(directory: Path) -> list[dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(directory)], check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_overlay(overlay: str) -> list[dict]:
    return render(DEPLOY / "overlays" / overlay)


def edited_overlay(overlay: str, tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the overlay in tmp_path whose kustomization `edit` changed in place, with paths as the overlay's own
    (`../../components/x`); the paths into deploy/ still point there. kustomize refuses absolute paths, hence paths
    relative to the copy."""
    copy = tmp_path / overlay
    shutil.copytree(DEPLOY / "overlays" / overlay, copy)
    kustomization = yaml.safe_load((copy / "kustomization.yaml").read_text())
    edit(kustomization)
    for field in ("resources", "components"):
        kustomization[field] = [os.path.relpath((DEPLOY / "overlays" / overlay / p).resolve(), copy)
                                if p.startswith("..") else p for p in kustomization.get(field, [])]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return copy


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
