"""SGLang 0.5.23's real engine on a CPU without SGLang's CPU kernels: loaded at interpreter start by every
Python process that has this folder on PYTHONPATH, SGLang's spawned scheduler and detokenizer included.

Nothing of SGLang changes on disk. Modules are patched as they are imported (`_PatchingFinder` runs a module's
patches right after its code ran), so a process that never imports SGLang pays nothing. What is patched, and why:
`sglang_cpu` (what this CPU needs, one function per SGLang module); `probe` (the engine's bytes of a request, for the
byte gate); `faults` (faults a test plants, one at a time, to show each gate fails; off unless planted).
`sgl_kernel` beside this file is a pure-torch stand-in for SGLang's kernel package; `torchvision` is an import-only
stand-in (its only wheels are CUDA builds that do not load beside the CPU torch), served only when no real
torchvision is installed.
"""

from __future__ import annotations

import importlib.abc
import sys

import sglang_cpu
import faults  # noqa: F401 - registers its patches (test instrumentation: planted faults, off until a test plants one)
import probe  # noqa: F401 - registers its patches (test instrumentation: the engine's bytes of probed requests)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds a patched module through the other finders and wraps its loader: `patch(module)` runs after the module's
    own code. Serves the torchvision stand-in when no other finder has torchvision."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name, path, target=None):
        stub = name == "torchvision" or name.startswith("torchvision.")
        if name in self._busy or (name not in sglang_cpu.PATCHES and not stub):
            return None
        self._busy.add(name)
        try:
            spec = self._real_spec(name, path, target)
        finally:
            self._busy.discard(name)
        if stub and spec is None:
            return sglang_cpu.torchvision_spec(name)
        if spec is None or spec.loader is None or name not in sglang_cpu.PATCHES:
            return spec
        spec.loader = _PatchingLoader(spec.loader, sglang_cpu.PATCHES[name])
        return spec

    def _real_spec(self, name, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, module_patches) -> None:
        self._loader = loader
        self._patches = module_patches

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            patch(module)

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self._loader, name)


sys.meta_path.insert(0, _PatchingFinder())
