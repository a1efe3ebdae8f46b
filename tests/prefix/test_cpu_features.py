"""The CPU features vLLM's CPU build decides by (tiercache.prefix.cpu_features): read from a cpuinfo file as the
kernel writes it, or named; each level implies the ones below it."""

from __future__ import annotations

import platform

import pytest

from tiercache.errors import InvalidArgument
from tiercache.prefix.cpu_features import LEVELS, detect, parse

AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"


@pytest.mark.parametrize("flags,level", [
    ("fpu sse2 avx avx2 fma", "avx2"),  # an AMD EPYC of the Zen 3 kind
    (f"avx2 {AVX512}", "avx512"),  # a Skylake server
    (f"avx2 {AVX512} avx512_bf16", "avx512_bf16"),  # a Zen 4, a Cooper Lake
    (f"avx2 {AVX512} avx512_bf16 amx_bf16 amx_tile amx_int8", "amx"),  # a Sapphire Rapids
    ("avx2 avx512f avx512_bf16", "avx512_bf16"),  # torch's BF16 check reads that bit alone (its AVX-512 one: VL,
])                                                # BW and DQ as well), and vLLM's state rule reads the BF16 one
def test_detect_reads_the_flags_line(tmp_path, monkeypatch, flags, level):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n")
    features = detect(cpuinfo)
    assert features.name == level and features.source == f"this machine ({cpuinfo})"
    assert features.accelerated_gdn == (level in ("avx512_bf16", "amx"))
    assert features.avx512 == (AVX512 in flags)


def test_a_machine_that_is_not_x86_or_has_no_cpuinfo_has_none(tmp_path, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    unread = detect(tmp_path / "missing")
    assert unread.name == "avx2" and not unread.accelerated_gdn and "unreadable: none assumed" in unread.source
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"flags\t\t: {AVX512} avx512_bf16 amx_tile\n")
    assert not detect(cpuinfo).accelerated_gdn


def test_each_named_level_implies_the_ones_below_and_says_its_rule():
    for rank, level in enumerate(LEVELS):
        features = parse(level)
        assert (features.avx512, features.avx512_bf16, features.amx) == (rank >= 1, rank >= 2, rank >= 3)
        assert features.name == level and features.rule().startswith(f"{level} from --cpu-features {level}: ")
    assert "reset to float32" in parse("avx512_bf16").rule() and "keeps its dtype" in parse("avx2").rule()
    with pytest.raises(InvalidArgument, match="--cpu-features 'sse4': one of avx2, avx512, avx512_bf16, amx"):
        parse("sse4")


def test_with_torch_installed_this_machine_is_what_torch_answers():
    torch = pytest.importorskip("torch")
    features = detect()
    assert features.source == "this machine (torch.cpu)"
    assert (features.avx512, features.avx512_bf16, features.amx) == (
        torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported())
