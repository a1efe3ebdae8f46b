"""Copy kernels: the torch references against index-based expectations (CPU, default run), every .cu compiled
with nvcc for sm_80 and sm_90, and the CUDA kernels against the references where a GPU exists (-m gpu)."""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources

import pytest
import torch

from tiercache import kernels
from tiercache.errors import InvalidArgument

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # (layers, num_blocks, block_size, heads, head_dim)
    (3, 6, 16, 2, 64), (2, 5, 17, 1, 80), (1, 9, 1, 3, 4), (4, 4, 8, 2, 3)]


def paged_layers(layers, blocks, block_size, heads, head_dim, dtype, layout, device="cpu", strided=False):
    shape = (2, blocks, block_size, heads, head_dim) if layout == "NHD" else (2, blocks, heads, block_size, head_dim)
    out = []
    for _ in range(layers):
        if strided:  # a view into a bigger buffer: non-default strides
            big = torch.randn(2, blocks + 3, *shape[2:], dtype=torch.float32).to(dtype)
            out.append(big[:, 1:1 + blocks].to(device))
        else:
            out.append(torch.randn(shape, dtype=torch.float32).to(dtype).to(device))
    return out


def token_row(layer, kv, slot, layout):
    block_size = layer.shape[2] if layout == "NHD" else layer.shape[3]
    block, pos = divmod(int(slot), block_size)
    return (layer[kv, block, pos] if layout == "NHD" else layer[kv, block, :, pos]).reshape(-1)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("token_offset", [0, 5])
def test_gather_matches_index_based_expectation(layout, dtype, shape, token_offset):
    layers_n, blocks, block_size, heads, head_dim = shape
    layers = paged_layers(*shape, dtype, layout, strided=token_offset == 5)
    generator = torch.Generator().manual_seed(sum(shape))
    n = min(7, blocks * block_size)
    slots = torch.randperm(blocks * block_size, generator=generator)[:n].to(torch.int64)
    chunk = torch.zeros(layers_n, 2, token_offset + n + 2, heads * head_dim, dtype=dtype)
    kernels.gather_kv(layers, slots, chunk, token_offset, layout)
    for li, layer in enumerate(layers):
        for kv in range(2):
            for i, slot in enumerate(slots):
                assert torch.equal(chunk[li, kv, token_offset + i], token_row(layer, kv, slot, layout))
            assert not chunk[li, kv, :token_offset].any() and not chunk[li, kv, token_offset + n:].any()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_is_the_exact_inverse(layout, dtype):
    shape = (2, 5, 16, 2, 8)
    source = paged_layers(*shape, dtype, layout)
    slots = kernels.slots_for_blocks([3, 0, 4], 16, start=5, count=30)
    chunk = torch.zeros(2, 2, 33, 16, dtype=dtype)
    kernels.gather_kv(source, slots, chunk, token_offset=3, layout=layout)
    target = [torch.zeros_like(layer) for layer in source]
    kernels.scatter_kv(target, slots, chunk, token_offset=3, layout=layout)
    written = set(slots.tolist())
    for src, dst in zip(source, target):
        for kv in range(2):
            for slot in range(5 * 16):
                row = token_row(dst, kv, slot, layout)
                if slot in written:
                    assert torch.equal(row, token_row(src, kv, slot, layout))
                else:
                    assert not row.any()


def test_slots_for_blocks():
    assert kernels.slots_for_blocks([7, 2], 4, start=2, count=5).tolist() == [30, 31, 8, 9, 10]
    with pytest.raises(InvalidArgument):
        kernels.slots_for_blocks([7, 2], 4, start=6, count=5)


@pytest.mark.parametrize("case", ["slot out of range", "negative slot", "wrong chunk width", "dtype mismatch",
                                  "offset overflow", "layers differ", "int32 slots", "bad layout"])
def test_bad_inputs_are_refused_before_any_copy(case):
    layers = paged_layers(2, 4, 8, 2, 4, torch.float16, "NHD")
    slots = torch.tensor([0, 5, 31], dtype=torch.int64)
    chunk = torch.zeros(2, 2, 4, 8, dtype=torch.float16)
    offset, layout = 0, "NHD"
    if case == "slot out of range":
        slots[2] = 32
    elif case == "negative slot":
        slots[0] = -1
    elif case == "wrong chunk width":
        chunk = torch.zeros(2, 2, 4, 9, dtype=torch.float16)
    elif case == "dtype mismatch":
        chunk = chunk.float()
    elif case == "offset overflow":
        offset = 2
    elif case == "layers differ":
        layers[1] = torch.zeros(2, 4, 8, 2, 5, dtype=torch.float16)
    elif case == "int32 slots":
        slots = slots.int()
    else:
        layout = "NDH"
    with pytest.raises(InvalidArgument):
        kernels.gather_kv(layers, slots, chunk, offset, layout)
    assert not chunk.any()


def state_pools(num_slots=6, device="cpu"):
    return [torch.randn(num_slots, 12, 4).to(torch.bfloat16).to(device),  # conv window, bf16
            torch.randn(num_slots, 2, 4, 4, device=device),  # SSM state, fp32
            torch.randn(num_slots, 3).to(torch.float16).to(device)]  # odd size: forces narrow copy units


def test_states_to_buffer_matches_index_based_expectation():
    pools = state_pools()
    slots = torch.tensor([4, 1, 5], dtype=torch.int64)
    buffer = torch.zeros(3, kernels.state_record_bytes(pools), dtype=torch.uint8)
    kernels.states_to_buffer(pools, slots, buffer)
    for i, slot in enumerate(slots.tolist()):
        expected = torch.cat([pool[slot].reshape(-1).view(torch.uint8) for pool in pools])
        assert torch.equal(buffer[i], expected)


def test_states_from_buffer_restores_only_the_given_slots():
    pools = state_pools()
    slots = torch.tensor([4, 1], dtype=torch.int64)
    buffer = torch.zeros(2, kernels.state_record_bytes(pools), dtype=torch.uint8)
    kernels.states_to_buffer(pools, slots, buffer)
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(restored, torch.tensor([0, 3]), buffer)
    for pool, target in zip(pools, restored):
        assert torch.equal(target[0], pool[4]) and torch.equal(target[3], pool[1])
        assert not target[[1, 2, 4, 5]].any()


def test_state_buffer_shape_is_checked():
    pools = state_pools()
    with pytest.raises(InvalidArgument):
        kernels.states_to_buffer(pools, torch.tensor([0]), torch.zeros(1, 7, dtype=torch.uint8))
    with pytest.raises(InvalidArgument):
        kernels.states_to_buffer(pools, torch.tensor([6]),
                                 torch.zeros(1, kernels.state_record_bytes(pools), dtype=torch.uint8))


def test_state_records_may_be_a_column_of_wider_rows():
    """An object spanning two pool sets: each set's records are a column of the objects' rows, written in place."""
    pools, other = state_pools(), [torch.randn(6, 5)]
    record, extra = kernels.state_record_bytes(pools), kernels.state_record_bytes(other)
    rows = torch.zeros(2, record + extra, dtype=torch.uint8)
    slots = torch.tensor([4, 1], dtype=torch.int64)
    kernels.states_to_buffer(pools, slots, rows[:, :record])
    kernels.states_to_buffer(other, slots, rows[:, record:])
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(rows[i], torch.cat([p[slot].reshape(-1).view(torch.uint8) for p in (*pools, *other)]))
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(restored, torch.tensor([0, 3]), rows[:, :record])
    assert all(torch.equal(r[0], p[4]) and torch.equal(r[3], p[1]) for r, p in zip(restored, pools))
    with pytest.raises(InvalidArgument):  # records that overlap are refused
        kernels.states_to_buffer(pools, slots, torch.zeros(record + 1, dtype=torch.uint8).as_strided((2, record),
                                                                                                   (1, 1)))


def test_prepared_state_pools_copy_as_the_pools_do():
    """state_pools checks once what every copy would (a connector prepares its pools at registration)."""
    pools = state_pools()
    prepared = kernels.state_pools(pools)
    assert kernels.state_record_bytes(prepared) == kernels.state_record_bytes(pools) == prepared.record_bytes
    slots = torch.tensor([4, 1], dtype=torch.int64)
    direct, through = (torch.zeros(2, prepared.record_bytes, dtype=torch.uint8) for _ in range(2))
    kernels.states_to_buffer(pools, slots, direct)
    kernels.states_to_buffer(prepared, slots, through)
    assert torch.equal(direct, through)
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(kernels.state_pools(restored), torch.tensor([0, 3]), through)
    assert all(torch.equal(r[0], p[4]) and torch.equal(r[3], p[1]) for r, p in zip(restored, pools))
    with pytest.raises(InvalidArgument):
        kernels.state_pools([pools[0], torch.zeros(3, 4)])  # another slot count
    with pytest.raises(InvalidArgument):
        kernels.state_pools([torch.zeros(4, 6)[:, ::2]])  # a slot's bytes not one run
    with pytest.raises(InvalidArgument):
        kernels.states_to_buffer(prepared, torch.tensor([6]), torch.zeros(1, prepared.record_bytes,
                                                                          dtype=torch.uint8))


def test_copy_unit_is_the_widest_that_divides_everything():
    assert kernels.launch.copy_unit(128, 4096, 256) == 16
    assert kernels.launch.copy_unit(160, 24) == 8
    assert kernels.launch.copy_unit(6, 4) == 2
    assert kernels.launch.copy_unit(3) == 1


NVCC = shutil.which("nvcc")
SOURCES = sorted(p.name for p in resources.files("tiercache.kernels.native").iterdir() if p.name.endswith(".cu"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_cuda_sources_compile(source, arch, tmp_path):
    if NVCC is None:
        pytest.skip("nvcc is not installed: CUDA sources were not compiled")
    path = resources.files("tiercache.kernels.native").joinpath(source)
    result = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-Werror", "all-warnings", "-o",
                             str(tmp_path / "out.cubin"), str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.cubin").stat().st_size > 0


# -- on a GPU ------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(6, 40, 16, 2, 256), (8, 30, 16, 4, 256)], ids=str)
@pytest.mark.parametrize("token_offset", [0, 7])
def test_cuda_kernels_match_the_reference(layout, dtype, shape, token_offset):
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    layers_n, blocks, block_size, heads, head_dim = shape
    layers = paged_layers(*shape, dtype, layout, device="cuda", strided=token_offset == 7)
    n = min(40, blocks * block_size)
    slots = torch.randperm(blocks * block_size, device="cuda")[:n].to(torch.int64)
    chunk = torch.zeros(layers_n, 2, token_offset + n, heads * head_dim, dtype=dtype, device="cuda")
    expected = chunk.clone()
    kernels.gather_kv(layers, slots, chunk, token_offset, layout)
    kernels.gather_kv_reference(layers, slots, expected, token_offset, layout)
    assert torch.equal(chunk, expected)
    target = [torch.zeros_like(layer) for layer in layers]
    reference = [torch.zeros_like(layer) for layer in layers]
    kernels.scatter_kv(target, slots, chunk, token_offset, layout)
    kernels.scatter_kv_reference(reference, slots, chunk, token_offset, layout)
    assert all(torch.equal(a, b) for a, b in zip(target, reference))


@gpu
def test_cuda_state_copies_match_the_reference():
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    pools = state_pools(device="cuda")
    slots = torch.tensor([4, 1, 5], dtype=torch.int64, device="cuda")
    buffer = torch.zeros(3, kernels.state_record_bytes(pools), dtype=torch.uint8, device="cuda")
    expected = buffer.clone()
    kernels.states_to_buffer(pools, slots, buffer)
    kernels.states_to_buffer_reference(pools, slots, expected)
    assert torch.equal(buffer, expected)
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(restored, slots, buffer)
    assert all(torch.equal(r[slots], p[slots]) for r, p in zip(restored, pools))


def _nvrtc():
    """libnvrtc from the nvidia-cuda-nvrtc wheel (dev extra): the compiler CuPy's RawModule uses at run time."""
    import ctypes
    import glob
    import os
    import sys

    pattern = os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "*", "lib", "libnvrtc*.so*")
    paths = sorted(p for p in glob.glob(pattern) if ".alt." not in p)
    builtins = [p for p in paths if "builtins" in p]
    library = [p for p in paths if "builtins" not in p]
    if not library:
        return None
    for path in builtins:  # nvrtc dlopens its builtins by name: load them first, globally
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(library[0])


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("source", SOURCES)
def test_cuda_sources_compile_with_nvrtc_as_cupy_does(source, arch):
    import ctypes

    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("libnvrtc is not installed (nvidia-cuda-nvrtc, dev extra on x86_64)")
    text = resources.files("tiercache.kernels.native").joinpath(source).read_text().encode()
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), text, source.encode(), 0, None, None) == 0
    options = [b"--std=c++17", f"--gpu-architecture={arch}".encode()]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    assert status == 0, log.value.decode()


@gpu
def test_cuda_gather_into_pinned_host_memory():
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    layers = paged_layers(3, 8, 16, 2, 128, torch.bfloat16, "NHD", device="cuda")
    slots = kernels.slots_for_blocks(torch.tensor([5, 1, 7], device="cuda"), 16, start=3, count=40)
    pinned = torch.zeros(3, 2, 40, 256, dtype=torch.bfloat16).pin_memory()
    kernels.gather_kv(layers, slots, pinned)
    torch.cuda.synchronize()
    expected = torch.zeros(3, 2, 40, 256, dtype=torch.bfloat16, device="cuda")
    kernels.gather_kv_reference(layers, slots, expected)
    assert torch.equal(pinned, expected.cpu())


@gpu
@pytest.mark.parametrize("where", ["cuda", "pinned"])
def test_cuda_state_copies_take_host_slots_and_spaced_records(where):
    """The vLLM connector's shape of call: block ids on the host, records a column of pinned (or device) rows."""
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    pools = state_pools(device="cuda")
    record = kernels.state_record_bytes(pools)
    rows = torch.zeros(3, record + 24, dtype=torch.uint8, device="cuda" if where == "cuda" else "cpu")
    if where == "pinned":
        rows = rows.pin_memory()
    host_slots = torch.tensor([4, 1, 5], dtype=torch.int64)
    kernels.states_to_buffer(pools, host_slots, rows[:, 24:])
    torch.cuda.synchronize()
    expected = torch.zeros(3, record, dtype=torch.uint8, device="cuda")
    kernels.states_to_buffer_reference(pools, host_slots.cuda(), expected)
    assert torch.equal(rows[:, 24:].cuda(), expected) and not rows[:, :24].any()
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(restored, torch.tensor([0, 3, 2]), rows[:, 24:])
    torch.cuda.synchronize()
    assert all(torch.equal(r[[0, 3, 2]], p[[4, 1, 5]]) for r, p in zip(restored, pools))


@gpu
def test_cuda_copies_with_host_slots_never_wait_for_the_gpu():
    """A launch queues behind the stream's work and returns: the host does not wait for a long kernel before it."""
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    pools = state_pools(device="cuda")
    rows = torch.zeros(2, kernels.state_record_bytes(pools), dtype=torch.uint8).pin_memory()
    layers = paged_layers(2, 8, 16, 2, 64, torch.bfloat16, "NHD", device="cuda")
    chunk = torch.zeros(2, 2, 20, 128, dtype=torch.bfloat16).pin_memory()
    slots = kernels.slots_for_blocks([5, 1], 16, start=3, count=20)
    kernels.states_to_buffer(pools, torch.tensor([4, 1]), rows)  # compiled, pinned pools warm
    kernels.gather_kv(layers, slots, chunk)
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # seconds of GPU time ahead of the copies
    busy = torch.cuda.Event()
    busy.record()
    kernels.states_to_buffer(pools, torch.tensor([5, 2]), rows)
    kernels.states_from_buffer(pools, torch.tensor([0, 3]), rows)
    kernels.gather_kv(layers, slots, chunk)
    kernels.scatter_kv(layers, slots, chunk)
    assert not busy.query()  # the host went on while the GPU still slept
    torch.cuda.synchronize()


@gpu
def test_cuda_state_copies_of_large_tensors():
    """States of MiBs per slot (a 4B model's SSM state), odd sizes beside them: every byte, once, into pinned rows."""
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    pools = [torch.randn(4, 16, 128, 128, device="cuda"),  # 1 MiB per slot
             torch.randn(4, 3, 1001).to(torch.bfloat16).to("cuda"),  # odd size: narrow units
             torch.randn(4, 8, 64, 64, device="cuda").to(torch.float16)]
    record = kernels.state_record_bytes(pools)
    slots = torch.tensor([3, 0], dtype=torch.int64)
    buffer = torch.zeros(2, record, dtype=torch.uint8).pin_memory()
    kernels.states_to_buffer(pools, slots, buffer)
    torch.cuda.synchronize()
    expected = torch.zeros(2, record, dtype=torch.uint8)
    kernels.states_to_buffer_reference([p.cpu() for p in pools], slots, expected)
    assert torch.equal(buffer, expected)
    restored = [torch.zeros_like(p) for p in pools]
    kernels.states_from_buffer(restored, torch.tensor([1, 2]), buffer)
    torch.cuda.synchronize()
    assert all(torch.equal(r[[1, 2]], p[[3, 0]]) and not r[[0, 3]].any() for r, p in zip(restored, pools))


@gpu
def test_cuda_prepared_state_pools_copy_on_any_stream():
    """Prepared on one stream (their arguments uploaded there), used on another: the connector's save stream."""
    if not _cuda_ready():
        pytest.skip("needs CUDA and CuPy")
    pools = state_pools(device="cuda")
    prepared = kernels.state_pools(pools)
    rows = torch.zeros(3, prepared.record_bytes, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kernels.states_to_buffer(prepared, torch.tensor([4, 1, 5]), rows)
    side.synchronize()
    expected = torch.zeros(3, prepared.record_bytes, dtype=torch.uint8, device="cuda")
    kernels.states_to_buffer_reference(pools, torch.tensor([4, 1, 5], device="cuda"), expected)
    assert torch.equal(rows.cuda(), expected)
