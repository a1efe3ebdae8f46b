"""scripts/seed_venv.py, which the engine venvs' install scripts run before pip: a distribution another venv holds at
the pinned version is hard-linked into the new venv (compiled bytecode included) and imports from there; its scripts
are rewritten for the new venv; what does not match the pin, is editable or comes from an unfinished venv is left to
pip. Real venvs (without pip, to stay quick) and a distribution laid out as pip lays one out."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
import venv
from pathlib import Path

from tests.helpers import ROOT

SEED = [sys.executable, str(ROOT / "scripts" / "seed_venv.py")]


def _site(env: Path) -> Path:
    return next(env.glob("lib/python3*/site-packages"))


def _venv(path: Path, finished: bool = True) -> Path:
    venv.create(path, with_pip=False)
    if finished:
        (path / ".installed-test").touch()
    return path


def _distribution(env: Path, name: str, version: str, *, editable: bool = False) -> Path:
    """A distribution as pip installs one: the module, its bytecode, a console script, METADATA and RECORD."""
    site = _site(env)
    module = site / name / "__init__.py"
    module.parent.mkdir()
    module.write_text(f"VERSION = {version!r}\n")
    compiled = Path(py_compile.compile(str(module), doraise=True))
    script = env / "bin" / f"{name}-cli"
    script.write_text(f"#!{env.resolve()}/bin/python\nimport {name}\nprint({name}.VERSION)\n")
    script.chmod(0o755)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
    if editable:
        (info / "direct_url.json").write_text(json.dumps({"url": "file:///src", "dir_info": {"editable": True}}))
    files = [module, compiled, info / "METADATA", script]
    (info / "RECORD").write_text("".join(f"{os.path.relpath(f, site)},,\n" for f in files) + f"{info.name}/RECORD,,\n")
    return module


def _seed(target: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([*SEED, str(target), *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def test_a_pinned_distribution_is_linked_with_its_bytecode_and_imports_from_the_new_venv(tmp_path):
    source, target = _venv(tmp_path / "a"), _venv(tmp_path / "b", finished=False)
    module = _distribution(source, "alpha", "2.13.0+cpu")
    pins = tmp_path / "requirements.txt"
    pins.write_text("# as the install scripts pass them: a file, then a pin of their own\nbeta==1.0\n")
    # `==2.13.0` is met by 2.13.0+cpu, as pip has it
    _seed(target, "-r", str(pins), "alpha==2.13.0", "--from", str(source))

    linked = _site(target) / "alpha" / "__init__.py"
    assert linked.stat().st_ino == module.stat().st_ino
    assert list((_site(target) / "alpha" / "__pycache__").glob("*.pyc"))
    out = subprocess.run([str(target / "bin" / "python"), "-c", "import alpha; print(alpha.__file__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(linked)
    script = target / "bin" / "alpha-cli"
    assert script.read_text().startswith(f"#!{target.resolve()}/bin/python\n") and os.access(script, os.X_OK)
    assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout == "2.13.0+cpu\n"


def test_what_does_not_match_the_pin_is_left_to_pip(tmp_path):
    source, unfinished = _venv(tmp_path / "a"), _venv(tmp_path / "u", finished=False)
    target = _venv(tmp_path / "b", finished=False)
    _distribution(source, "alpha", "2.13.0+cu130")
    _distribution(source, "beta", "1.0")
    _distribution(source, "gamma", "1.0", editable=True)
    _distribution(unfinished, "delta", "1.0")
    result = _seed(target, "alpha==2.13.0+cpu", "beta==1.1", "gamma==1.0", "delta==1.0",
                   "--from", str(source), "--from", str(unfinished))
    assert "0 distributions linked" in result.stdout, result.stdout
    assert not list(_site(target).glob("*.dist-info"))


def test_a_distribution_the_venv_has_is_not_replaced(tmp_path):
    source, target = _venv(tmp_path / "a"), _venv(tmp_path / "b", finished=False)
    _distribution(source, "alpha", "1.0")
    own = _distribution(target, "alpha", "0.9")
    _seed(target, "alpha==1.0", "--from", str(source))
    assert own.read_text() == "VERSION = '0.9'\n"
