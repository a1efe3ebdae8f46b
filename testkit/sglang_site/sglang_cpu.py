"""What SGLang 0.5.23's engine needs to run on this CPU (torch 2.13.0+cpu, no AMX, no Triton driver), one patch per
SGLang module, applied by sitecustomize's import hook right after the module's own code ran.

Each patch is the smallest change that lets SGLang's own code run: SGLang's control flow (scheduler, radix caches,
HiCache controller, prefetch and backup threads, storage backends) is never replaced; where SGLang calls a kernel
that exists only for CUDA, the patch puts a plain-indexing torch function with the kernel's meaning in its place.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys

PATCHES: dict[str, list] = {}  # module name -> its patches, run in registration order (this module's first)


def patches(module_name: str):
    """Register `function(module)` to run right after `module_name`'s own code (probe.py and faults.py register
    theirs here too)."""
    def register(function):
        PATCHES.setdefault(module_name, []).append(function)
        return function
    return register


# -- torchvision: an import-only stand-in ------------------------------------------------------------------------------

class _Unavailable:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("torchvision is an import-only stand-in in SGLang's CPU test harness")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__version__ = "0.0.0+stub"
        module.__path__ = []  # a package: every torchvision.x.y imports
        module.InterpolationMode = InterpolationMode

        def missing(attribute: str):
            if attribute.startswith("_"):
                raise AttributeError(attribute)
            return type(attribute, (_Unavailable,), {})
        module.__getattr__ = missing


_transformers_asked = False


def torchvision_spec(name: str):
    """The stand-in's spec, once transformers has cached that torchvision is *not* available (it asks once,
    lru_cache): transformers then never tries to use it, while SGLang's modules that import it load."""
    global _transformers_asked
    if not _transformers_asked:
        _transformers_asked = True  # also guards the find_spec below against answering itself
        import transformers.utils.import_utils as import_utils

        import_utils.is_torchvision_available()
    if _transformers_is_asking():
        return None
    return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


def _transformers_is_asking() -> bool:
    """True while transformers' own availability check (is_torchvision_available) is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "is_torchvision_available":
            return True
        frame = frame.f_back
    return False


# -- HiCache's host memory: plain memory, not CUDA-pinned -------------------------------------------------------------

def _unpinned(cls) -> None:
    """`cls(...)` builds its host pool with pin_memory=False whatever its caller passed (SGLang passes nothing: the
    default True asks CUDA to pin the memory, and `torch.empty(pin_memory=True)` needs an accelerator)."""
    import functools
    import inspect

    init = cls.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["pin_memory"] = False
        init(*bound.args, **bound.kwargs)
    cls.__init__ = __init__


@patches("sglang.srt.mem_cache.pool_host.common")
def _no_host_register(module) -> None:
    """cudaHostRegister / cudaHostUnregister of the host pools (only reached with pin_memory, kept off as well)."""
    module._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None
    module._cuda_host_unregister = lambda buffer: None


@patches("sglang.srt.mem_cache.pool_host.base")
def _unpinned_host_pools(module) -> None:
    """Host pools in plain memory; and SGLang's reserve of 10 GiB of free RAM before it sizes one (a server's
    margin) cut to 512 MiB: the test pools are a few MiB, and a 2-core CI machine running several test suites has
    less than 10 GiB free (SGLang then refuses to start: "only have -4.53 GB free")."""
    _unpinned(module.HostKVCache)
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 512 << 20


@patches("sglang.srt.mem_cache.pool_host.mha")
def _mha_direct_transfers(module) -> None:
    """SGLang imports the `direct` io backend's transfer functions only on CUDA / ROCm / XPU; on the CPU the names are
    missing from the module, and `hicache_io_backend="direct"` is the one backend that can run here."""
    from sgl_kernel import kvcacheio

    for name in ("transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"):
        setattr(module, name, getattr(kvcacheio, name))


@patches("sglang.srt.mem_cache.pool_host.mamba")
def _mamba_host_pool(module) -> None:
    """The Mamba host pool: the same direct transfers, and plain memory (it does not go through HostKVCache's
    constructor, so it is unpinned on its own)."""
    _mha_direct_transfers(module)
    _unpinned(module.MambaPoolHost)


@patches("torch.cpu")
def _cpu_stream_synchronize(module) -> None:
    """torch.cpu.Stream stands in for a device stream in SGLang's device-agnostic code but has no synchronize().
    HiCache's L2 transfer engine calls it when a transfer raises (mem_cache/l2_transfer.py): without it the
    transfer's own error (e.g. a missing transfer function) is hidden behind an AttributeError. CPU work is done
    when the call that queued it returns."""
    if not hasattr(module.Stream, "synchronize"):
        module.Stream.synchronize = lambda self: None


# -- Triton kernels a hybrid model reaches on the CPU (Triton has no CPU driver here) ----------------------------------

@patches("sglang.kernels.ops.attention.fla.fused_norm_gate")
def _rms_norm_gated(module) -> None:
    """FusedRMSNormGated (Qwen3-Next's gated norm after the GDN output) runs a Triton kernel unless the CPU has AMX:
    the same arithmetic in torch (float32, as the kernel computes)."""
    import torch

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("the CPU harness's FusedRMSNormGated has no residual path")
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        gate = g.reshape(x.shape).float()
        y = y * gate * torch.sigmoid(gate) if self.activation in ("swish", "silu") else y * torch.sigmoid(gate)
        return y.to(x.dtype)
    module.FusedRMSNormGated.forward = forward


@patches("sglang.srt.models.qwen2_moe")
def _shared_expert_gate(module) -> None:
    """Qwen2/3 MoE blocks (Qwen3-Next's included) add the gated shared expert with a Triton kernel on every non-AMX,
    non-NPU machine: final += sigmoid(hidden . gate_weight) * shared, in float32 as the kernel does."""
    import torch

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
        final_hidden_states.copy_(final_hidden_states.float() + gate * shared_output.float())
    module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add
