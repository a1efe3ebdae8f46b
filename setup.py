"""The build step that makes a wheel or sdist built from a clone complete: the protobuf stubs (tiercache/_proto/
*_pb2*.py, generated, never committed) are produced by protoc while the package is built. Everything else about the
package is declared in pyproject.toml; grpcio-tools is a build requirement there, pinned to the version whose
generated code the runtime dependencies (grpcio, protobuf) are declared to satisfy.

`make proto` (= scripts/install.sh) and `pip install -e .` run this too: an editable install generates the stubs
into the source tree, any other build into the build directory that becomes the wheel.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO = "proto/tiercache.proto"


def protoc_command(out_dir: str) -> list[str]:
    """The one command that generates the stubs: `-Itiercache/_proto=proto` makes the generated modules import each
    other as `tiercache._proto.*`."""
    return [sys.executable, "-m", "grpc_tools.protoc", "-Itiercache/_proto=proto", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", PROTO]


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        out_dir = ROOT if self.editable_mode else Path(self.build_lib).resolve()
        stubs = out_dir / "tiercache" / "_proto"
        self.announce(f"generating the protobuf stubs from {PROTO} into {stubs}", logging.INFO)
        stubs.mkdir(parents=True, exist_ok=True)
        subprocess.run(protoc_command(str(out_dir)), cwd=ROOT, check=True)


setup(cmdclass={"build_py": BuildWithStubs})
