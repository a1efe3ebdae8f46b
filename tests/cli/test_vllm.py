"""`tiercache layout` and `tiercache check-vllm` (tiercache.cli.vllm): N, u and the bytes before a start, the
connector's refusals from vLLM's own flags, and bad input as one line with exit 2. (The same N and the same
refusals on vLLM's real engine: tests/vllm_engine/test_block_size.py, tests/vllm_engine/test_early_refusals.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiercache.cli import main
from tests.helpers import python_env
from tests.prefix.hf_configs import QWEN35_08B
from testkit.vllm_models import FOUR_LAYER
from tiercache.prefix.cpu_features import detect

CONNECTOR = {"kv_connector": "TierCacheConnector", "kv_connector_module_path": "tiercache.connector.vllm",
             "kv_role": "kv_both", "kv_connector_extra_config": {"url": "grpc://127.0.0.1:1"}}


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "Qwen3.5-0.8B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN35_08B))
    return directory


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_layout_prints_n_u_and_the_bytes_per_rank(model_dir, capsys):
    code, out, err = _run(capsys, "layout", str(model_dir))
    assert code == 0 and err == ""
    lines = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith(("kv chunk", "vLLM")))
    assert lines["N"].startswith("544 tokens") and lines["u"].startswith("16 tokens")
    assert lines["platform"].startswith("cuda: GPU, FlashAttention 2/3: kernel blocks of 16 tokens")
    assert lines["kv"] == "2048 bytes per token per attention layer, 12288 per token over 6 layers"
    assert lines["state"] == "1.0 MiB (1085440 bytes) per recurrent layer, 18.6 MiB (19537920 bytes) per state over " \
                             "18 layers"
    assert "vLLM flags  --prefix-match-unit 16 --prefix-cache-retention-interval 544" in out.splitlines()


def test_layout_json_follows_the_flags(model_dir, capsys):
    code, out, _ = _run(capsys, "layout", str(model_dir), "--json", "-tp", "2", "--kv-cache-dtype", "fp8")
    report = json.loads(out)
    assert code == 0 and report["tensor_parallel_size"] == 2 and report["dtypes"]["kv"] == "float8_e4m3fn"
    assert report["kv_bytes_per_token"] == 6 * 512 and report["state_bytes_per_layer"] == 1_085_440 // 2
    # 1 KV head of fp8 and half the state each: the same tokens per state as one fp8 rank
    assert report["block_tokens"] == 1072 and report["vllm_flags"][-1] == "1072"


@pytest.mark.parametrize("level,n,ssm", [("avx2", 128, "bfloat16"), ("avx512", 128, "bfloat16"),
                                         ("avx512_bf16", 256, "float32"), ("amx", 256, "float32")])
def test_layout_on_the_cpu_platform_gives_the_real_engines_n_for_the_cpu_named(tmp_path, capsys, level, n, ssm):
    (tmp_path / "config.json").write_text(json.dumps(FOUR_LAYER.config_fields()))
    code, out, _ = _run(capsys, "layout", str(tmp_path), "--platform", "cpu", "--json", "--cpu-features", level)
    report = json.loads(out)
    assert code == 0 and (report["block_tokens"], report["dtypes"]["ssm"], report["cpu"]) == (n, ssm, level)
    assert report["cpu_rule"].startswith(f"{level} from --cpu-features {level}: ")
    code, out, _ = _run(capsys, "layout", str(tmp_path), "--platform", "cpu", "--cpu-features", level)
    assert f"\ncpu         {report['cpu_rule']}\n" in out


def test_layout_on_the_cpu_platform_reads_this_machines_cpu(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(FOUR_LAYER.config_fields()))
    code, out, _ = _run(capsys, "layout", str(tmp_path), "--platform", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["cpu_rule"].startswith(f"{detect().name} from {detect().source}: ")
    assert report["block_tokens"] == FOUR_LAYER.sizing(detect().name).block_tokens


def _check(capsys, model_dir, *flags: str, connector: dict | None = None) -> tuple[int, list[str], str]:
    code, out, err = _run(capsys, "check-vllm", "--vllm-version", "0.33.0", str(model_dir), *flags,
                          "--kv-transfer-config", json.dumps(connector or CONNECTOR))
    return code, out.splitlines(), err


def test_check_vllm_says_ok_with_n_and_u(model_dir, capsys):
    code, lines, err = _check(capsys, model_dir, "--enable-prefix-caching", "--prefix-match-unit", "16",
                              "--prefix-cache-retention-interval", "544", "--max-model-len", "8192")
    assert code == 0 and err == ""
    assert lines[0] == f"checked for vLLM 0.33.0 (--vllm-version), platform cuda: {model_dir} (qwen3_5_text)"
    assert lines[1:] == ["ok: TierCacheConnector starts with N=544, u=16 (`tiercache layout` has the bytes)",
                         "not read: --max-model-len"]


def test_check_vllm_says_the_connectors_refusal_without_prefix_caching(model_dir, capsys):
    code, lines, _ = _check(capsys, model_dir, "--no-enable-prefix-caching")
    assert code == 1
    assert lines[1:] == ["refused: TierCacheConnector needs vLLM's Mamba cache mode 'align', got 'none' (no state "
                         "kept per block): start vLLM with --enable-prefix-caching (vLLM 0.33.0 derives the mode from "
                         "it; --mamba-cache-mode is deprecated and has no effect)"]


def test_check_vllm_says_every_refusal_and_what_needs_n(model_dir, capsys):
    connector = {**CONNECTOR, "kv_connector_extra_config": {"url": "grpc://h:1", "match_unit": 48}}
    code, lines, _ = _check(capsys, model_dir, "--prefix_match_unit=96", "--prefix-cache-retention-interval", "500",
                            connector=connector)
    assert code == 1
    assert lines[1:4] == [
        "refused: TierCacheConnector: u=48 must be positive and divide N=544",
        "refused: vLLM refuses --prefix-match-unit 96: N=544 is not a multiple of it (KV cache group block sizes "
        "must be divisible by prefix_match_unit)",
        "refused: vLLM refuses --prefix-cache-retention-interval 500: not a multiple of the block size N=544 (pass "
        "544 to keep a state at every block)"]
    connector = {"kv_connector": "TierCacheConnector", "kv_connector_extra_config": {"urll": 1}}
    code, lines, _ = _check(capsys, model_dir, "--speculative-config", '{"num_speculative_tokens": 2}',
                            connector=connector)
    assert code == 1 and len(lines) == 5
    for line, start in zip(lines[1:], ['refused: vLLM finds TierCacheConnector only with "kv_connector_module_path": ',
                                       "refused: vLLM needs a kv_role with a kv_connector",
                                       "refused: unknown kv_connector_extra_config keys for TierCacheConnector: urll",
                                       "refused: TierCacheConnector does not support speculative decoding"]):
        assert line.startswith(start), line


def test_check_vllm_notes_what_costs_hits(model_dir, capsys):
    code, lines, _ = _check(capsys, model_dir)
    assert code == 0 and lines[1].startswith("ok: TierCacheConnector starts with N=544, u=16")
    assert lines[2].startswith("note: vLLM hashes prompts every 544 tokens") and "--prefix-match-unit 16" in lines[2]
    assert lines[3].startswith("note: without --prefix-cache-retention-interval 544 vLLM keeps no state")


@pytest.mark.parametrize("argv,message", [
    (["layout", "{dir}/missing"], "tiercache layout: error: no config.json for '{dir}/missing': pass the model's "
                                  "directory (nothing is downloaded)"),
    (["layout", "{dir}", "--kv-cache-dtype", "nvfp4"], "tiercache layout: error: argument --kv-cache-dtype: invalid "
                                                       "choice: 'nvfp4'"),
    (["check-vllm", "{dir}", "--kv-transfer-config", "{bad"], "tiercache check-vllm: error: --kv-transfer-config is "
                                                               "not JSON: "),
    (["check-vllm", "{dir}"], "tiercache check-vllm: error: --kv-transfer-config names no TierCacheConnector"),
    (["layout", "{dir}", "--cpu-features", "avx2"], "tiercache layout: error: --cpu-features describes a CPU "
                                                     "engine's host: it needs --platform cpu, not cuda"),
    (["check-vllm", "--cpu-features", "avx2", "{dir}", "--kv-transfer-config", json.dumps(CONNECTOR)],
     "tiercache check-vllm: error: --cpu-features describes a CPU engine's host: it needs --platform cpu, not cuda"),
    (["layout", "{dir}", "--platform", "cpu", "--cpu-features", "sse"], "tiercache layout: error: argument "
                                                                         "--cpu-features: invalid choice: 'sse'"),
    (["check-vllm", "{dir}", "--block-size", "x"], "tiercache check-vllm: error: vLLM flags: argument --block-size: "
                                                    "expected a positive integer, got 'x'"),
    (["check-vllm", "{dir}", "--prefix-match-unit", "0", "--kv-transfer-config", json.dumps(CONNECTOR)],
     "tiercache check-vllm: error: vLLM flags: argument --prefix-match-unit: expected a positive integer, got '0'"),
    (["check-vllm", "{dir}", "--speculative-config", '{"num_speculative_tokens": "2"}', "--kv-transfer-config",
      json.dumps(CONNECTOR)], "tiercache check-vllm: error: --speculative-config: num_speculative_tokens must be a "
                              "count, got '2'"),
])
def test_bad_input_is_one_line_and_exit_2(model_dir, argv, message):
    argv = [a.replace("{dir}", str(model_dir)) for a in argv]
    result = subprocess.run([sys.executable, "-m", "tiercache", *argv], capture_output=True, text=True, timeout=60,
                            env=python_env())
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(message.replace("{dir}", str(model_dir)))


def test_a_model_tiercache_cannot_size_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_key_value_heads": 8}))
    code, _, err = _run(capsys, "layout", str(tmp_path))
    assert code == 2 and err.startswith("tiercache layout: error: model_type 'llama' is not a hybrid model tiercache "
                                        "knows")
    code, lines, _ = _check(capsys, tmp_path, "--no-enable-prefix-caching")
    assert code == 0 and lines[1] == "ok: TierCacheConnector starts (N is vLLM's block size: no recurrent layers)"


def test_check_vllm_imports_no_vllm_and_says_which_it_words_for(model_dir):
    script = ("import sys; from tiercache.cli import main; "
              f"main(['check-vllm', {str(model_dir)!r}, '--kv-transfer-config', {json.dumps(CONNECTOR)!r}]); "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env=python_env())
    first, *_, last = result.stdout.splitlines()
    assert last == "[]", result.stderr
    # (this venv has no vLLM: the lines are worded for the default, and it says so)
    assert "(no vLLM installed here: pass --vllm-version for another)" in first
