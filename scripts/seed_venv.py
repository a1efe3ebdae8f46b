#!/usr/bin/env python3
"""Seeds a new virtual environment with the pinned distributions a sibling environment already holds, by hard links,
before pip installs the rest: what `uv` does from its cache, done from the checkout's own venvs.

Every engine's venv (scripts/install_vllm_cpu.sh, install_vllm.sh, install_sglang.sh, install_dynamo.sh) pins its
packages and installs them with --no-deps, and most of their bytes are the same wheels at the same versions: torch
(about 1 GB unpacked) is in four of them, triton (1 GB) in two. pip unpacks and byte-compiles each copy again. A
distribution found in another venv of this checkout, of the same Python, at exactly the pinned version, is linked
here instead, file by file as its RECORD lists them, compiled bytecode included (a .pyc is checked against its
source's size and modification time, which a hard link shares, and Python names the loading file in its code
objects, not the one it was compiled from). pip then finds it installed and skips it.

What is not linked:
- files outside site-packages (console scripts, data): copied, with the other venv's path in a script's text
  replaced by this one's, as pip would have written them;
- a distribution this venv already has (any version), or one installed editable;
- anything, where the two venvs are on different filesystems (no hard links): pip installs it all as before.
Only a venv whose own install finished (an `.installed-*` stamp, written last by every install script) is a source.
Nothing in either venv is changed in place: pip replaces a file by removing it, so a link never carries a later change
from one venv into another.

Usage: python3 scripts/seed_venv.py VENV [-r REQUIREMENTS]... [NAME==VERSION]... [--from OTHER_VENV]...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(requirement_files: list[str], specs: list[str]) -> dict[str, str]:
    """name -> version for every `name==version` line (extras and markers ignored: the scripts pin plain names)."""
    lines = list(specs)
    for path in requirement_files:
        lines += Path(path).read_text().splitlines()
    found = {}
    for line in lines:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if match:
            found[canonical(match.group(1))] = match.group(3)
    return found


def site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def installed(site: Path) -> dict[str, tuple[Path, str]]:
    """name -> (.dist-info directory, version) of every distribution in `site`."""
    found = {}
    for info in site.glob("*.dist-info"):
        name, version = metadata(info)
        if name:
            found[canonical(name)] = (info, version or "")
    return found


def metadata(info: Path) -> tuple[str | None, str | None]:
    name = version = None
    try:
        with open(info / "METADATA", encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
                elif not line.strip():
                    break
    except OSError:
        return None, None
    return name, version


def satisfies(version: str, pinned: str) -> bool:
    """PEP 440's `==` for these pins: `torch==2.13.0` is met by 2.13.0+cpu, `torch==2.13.0+cpu` only by itself."""
    return version == pinned or ("+" not in pinned and version.split("+", 1)[0] == pinned)


def editable(info: Path) -> bool:
    try:
        return json.loads((info / "direct_url.json").read_text()).get("dir_info", {}).get("editable", False)
    except (OSError, ValueError):
        return False


def sources(target: Path, candidates: list[Path]) -> list[Path]:
    """The venvs among `candidates` whose install finished, for the same Python as `target`."""
    python = site_packages(target).parent.name
    found = []
    for venv in candidates:
        if venv.resolve() == target.resolve() or not any(venv.glob(".installed-*")):
            continue
        site = site_packages(venv)
        if site is not None and site.parent.name == python:
            found.append(venv)
    return found


def record(info: Path) -> list[str]:
    """The files pip installed for the distribution (an OSError where it left no RECORD)."""
    return [line.split(",", 1)[0] for line in (info / "RECORD").read_text().splitlines() if line.strip()]


def link_distribution(info: Path, source: Path, target: Path) -> None:
    """Links (or, outside site-packages, copies) every file of the distribution."""
    source_site, target_site = site_packages(source), site_packages(target)
    for relative in record(info):
        origin = (source_site / relative).resolve()
        if not origin.is_file():
            continue  # a RECORD may list a file a later step removed
        inside = origin.is_relative_to(source_site.resolve())
        if not inside and not origin.is_relative_to(source.resolve()):
            continue  # outside the venv: nothing pip would have written into this one
        destination = (target_site / relative) if inside else target / origin.relative_to(source.resolve())
        if destination.exists():
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        if inside:
            os.link(origin, destination)
        else:
            copy_script(origin, destination, source, target)


def copy_script(origin: Path, destination: Path, source: Path, target: Path) -> None:
    data = origin.read_bytes()
    if data.startswith(b"#!"):
        data = data.replace(str(source.resolve()).encode(), str(target.resolve()).encode())
    destination.write_bytes(data)
    destination.chmod(origin.stat().st_mode & 0o777)


def links_work(source: Path, target: Path) -> bool:
    probe = site_packages(target) / ".seed-probe"
    try:
        os.link(next(site_packages(source).glob("*.dist-info")) / "METADATA", probe)
    except (OSError, StopIteration):
        return False
    probe.unlink()
    return True


def seed(target: Path, wanted: dict[str, str], candidates: list[Path]) -> list[str]:
    have = installed(site_packages(target))
    seeded = []
    for source in sources(target, candidates):
        if not links_work(source, target):
            continue
        for name, (info, version) in installed(site_packages(source)).items():
            pinned = wanted.get(name)
            if pinned is None or name in have or editable(info) or not satisfies(version, pinned):
                continue
            try:
                link_distribution(info, source, target)
            except OSError as error:  # what was linked stays; pip installs the distribution over it
                print(f"seed_venv: {info.name} not linked ({error}): pip installs it", file=sys.stderr)
                continue
            have[name] = (info, version)
            seeded.append(f"{info.name} (from {source.name})")
    return seeded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("-r", dest="requirements", action="append", default=[])
    parser.add_argument("specs", nargs="*", help="NAME==VERSION")
    parser.add_argument("--from", dest="candidates", type=Path, action="append",
                        help="a venv to link from (default: every .venv* of this checkout)")
    args = parser.parse_intermixed_args()
    if site_packages(args.venv) is None:
        print(f"seed_venv: {args.venv} is not a virtual environment", file=sys.stderr)
        return 1
    candidates = args.candidates or sorted(ROOT.glob(".venv*"))
    seeded = seed(args.venv, pins(args.requirements, args.specs), candidates)
    print(f"seed_venv: {len(seeded)} distributions linked into {args.venv} from this checkout's other venvs"
          + (f": {', '.join(sorted(seeded))}" if len(seeded) <= 12 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
