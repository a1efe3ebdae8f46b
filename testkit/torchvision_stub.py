"""An import-only torchvision for SGLang's storage tests and benchmarks/sglang_storage_calls.py
(tests/sglang/conftest.py: why): modules and names exist, nothing works.

transformers asks once whether torchvision is available and caches the answer: it is asked before the stub goes in,
so transformers never tries to use it."""

import enum
import importlib.util
import sys
import types

import transformers.utils.import_utils as import_utils

import_utils.is_torchvision_available()  # cached as False before the stub exists


class _Unavailable:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("torchvision is a stub in these tests")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)

    def missing(attribute: str):
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return type(attribute, (_Unavailable,), {})
    module.__getattr__ = missing
    sys.modules[name] = module
    return module


if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
    torchvision = _module("torchvision", __version__="0.0.0+stub")
    torchvision.transforms = _module("torchvision.transforms")
    torchvision.transforms.functional = _module("torchvision.transforms.functional",
                                                InterpolationMode=InterpolationMode)
