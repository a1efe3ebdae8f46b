"""The container image, checked offline (no container engine here; hadolint runs in tests/deploy/test_deploy.py):
one tag scheme everywhere, a default command that serves with the embedded defaults from inside a container, and
`docker run` lines in the docs that give the host tier room in /dev/shm and publish the ports the server announces."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

import tiercache
from tests.helpers import ROOT
from tiercache.cli import build_parser, config_from_args
from tiercache.config import Config

DOCKERFILE = (ROOT / "Dockerfile").read_text()
VERSION = tiercache.__version__
TAGS = {VERSION, f"{VERSION}-gpu"}
DOCS = [ROOT / "Dockerfile", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cmd() -> list[str]:
    return json.loads(re.search(r"^CMD (\[.*?\])$", DOCKERFILE.replace("\\\n", " "), re.M).group(1))


def _serve(args: list[str]) -> Config:
    return config_from_args(build_parser().parse_args(["serve", *args]))


def _exposed() -> set[int]:
    return {int(p) for p in re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()}


def test_image_tags_are_the_package_version_everywhere():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "tiercache.__version__" }' in pyproject  # one version: the package's
    seen = {}
    for path in DOCS:
        for tag in re.findall(r"\btiercache:(\d[\w.\-]*\w)", path.read_text()):
            seen.setdefault(tag, set()).add(path.name)
    assert seen and set(seen) <= TAGS, f"image tags other than {sorted(TAGS)}: {seen}"
    assert {"Dockerfile", "README.md", "deploy.md"} <= set().union(*seen.values())
    for overlay in ("base", "overlays/cpu", "overlays/gpu", "overlays/redis-cluster"):
        kustomization = yaml.safe_load((ROOT / "deploy" / overlay / "kustomization.yaml").read_text())
        for image in kustomization.get("images", []):
            assert image["name"] == "tiercache" and image["newTag"] == (
                f"{VERSION}-gpu" if overlay == "overlays/gpu" else VERSION), overlay


def test_the_default_command_serves_the_embedded_defaults_to_other_containers():
    """Without a mounted config file: every flag parses with `tiercache serve`'s own parser, it listens on all
    interfaces, on the ports the image exposes, and keeps its disk tier in the image user's home."""
    cmd = _cmd()
    assert "--config" not in cmd
    config = _serve(cmd)
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert _exposed() == {config.server.port, config.server.data_port, config.security.health_port,
                          config.server.metrics_port}
    home = re.search(r"useradd .*--home-dir (\S+)", DOCKERFILE).group(1)
    assert Path(config.disk.path).is_relative_to(home)
    assert config.host.capacity_bytes == Config().host.capacity_bytes  # the embedded default the docs size for


def test_the_image_copies_what_building_the_package_reads():
    copied = {source for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M) for source in line.split()[:-1]}
    assert {"pyproject.toml", "setup.py", "README.md", "proto", "scripts", "tiercache"} <= copied


def _docker_size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([bkmg]?)", text.lower()).groups()
    return int(number) << {"": 0, "b": 0, "k": 10, "m": 20, "g": 30}[unit]


def _docker_runs() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in re.findall(r"docker run [^\n`]*", text):
            found.append((path.name, shlex.split(line)[2:]))
    return found


def test_docker_run_lines_give_the_host_tier_room_and_publish_the_announced_ports():
    """Docker's /dev/shm is 64 MB unless --shm-size (or the host's, --ipc=host); the server announces its data port
    to clients, who dial it at the address they reached gRPC on: it must be published under its own number."""
    runs = _docker_runs()
    assert {"README.md", "deploy.md", "Dockerfile"} <= {name for name, _ in runs}
    for name, words in runs:
        image = next(i for i, w in enumerate(words) if re.fullmatch(r"(\S+/)?tiercache:\S+", w))
        options, args = words[:image], words[image + 1:]
        assert words[image].split(":")[-1] in TAGS, f"{name}: {words[image]}"
        config = _serve(args or _cmd())  # arguments after the image replace the CMD
        assert config.server.host == "0.0.0.0", f"{name}: unreachable from outside the container: {words}"
        if "--ipc=host" not in options and "--ipc" not in options:
            assert "--shm-size" in options, f"{name}: docker run without --shm-size or --ipc=host: {words}"
            shm = _docker_size(options[options.index("--shm-size") + 1])
            assert shm > config.host.capacity_bytes, f"{name}: --shm-size below the host tier"
        published = {}
        for i, word in enumerate(options):
            if word in ("-p", "--publish"):
                host_port, container_port = options[i + 1].rsplit(":", 2)[-2:]
                published[int(container_port)] = int(host_port)
        for port in (config.server.port, config.server.data_port):
            assert published.get(port) == port, f"{name}: port {port} is not published as {port}: {words}"
