"""The SGLang backend tests need SGLang, which lives in its own venv (scripts/install_sglang.sh; `make test-sglang`).

SGLang's host memory pools import `sglang.srt.configs`, which imports torchvision; the only torchvision wheels the
package index has are CUDA builds that do not load beside the CPU torch. The pools themselves use none of it, so
`testkit/torchvision_stub.py` puts an import-only stand-in in place for these tests (a real deployment has
torchvision)."""

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["*.py"]
else:
    from testkit import torchvision_stub  # noqa: F401 - before any SGLang module that needs it
