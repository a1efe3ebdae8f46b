"""The secondary tier's entry (tiercache.connector.vllm_tier.settings) and the command that prints it: the tier
refuses to start without the model identity vLLM does not give it, and with a key it does not know; `tiercache
vllm-tier` prints an entry the tier takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import python_env
from tiercache.connector.vllm_tier.settings import TierSettings
from tiercache.errors import InvalidArgument

IDENTITY = "weights=w;quant=None;cache=auto;overrides=none"


def test_an_entry_without_model_identity_is_refused_naming_the_command():
    with pytest.raises(InvalidArgument, match="tiercache vllm-tier"):
        TierSettings.from_tier_kwargs({"url": "grpc://127.0.0.1:1"})


def test_an_unknown_key_is_refused_and_vllms_own_keys_are_taken():
    with pytest.raises(InvalidArgument, match="n_read_threads"):
        TierSettings.from_tier_kwargs({"model_identity": IDENTITY, "n_read_threads": 4})
    settings = TierSettings.from_tier_kwargs({"model_identity": IDENTITY, "locality": "REMOTE",
                                              "url": "grpc://127.0.0.1:1", "lookup_deadline_s": 0.2})
    assert settings.connection.url == "grpc://127.0.0.1:1" and settings.lookup_deadline_s == 0.2


def test_vllm_tier_prints_an_entry_the_tier_takes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    out = subprocess.run([sys.executable, "-m", "tiercache", "vllm-tier", "--url", "grpc://127.0.0.1:9", str(model),
                          "--dtype", "bfloat16", "--hf-overrides", '{"rope_parameters": {"factor": 2.0}}'],
                         capture_output=True, text=True, timeout=60, env=python_env(), check=True)
    entry = json.loads(out.stdout)
    assert entry["type"] == "TierCacheTier" and entry["module_path"] == "tiercache.connector.vllm_tier"
    settings = TierSettings.from_tier_kwargs({k: v for k, v in entry.items() if k not in ("type", "module_path")})
    assert settings.connection.url == "grpc://127.0.0.1:9" and "overrides=none" not in settings.model_identity


def test_vllm_tier_says_bad_input_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for args in (["/nonexistent-model"], [str(tmp_path), "--hf-overrides", "{not json"]):
        out = subprocess.run([sys.executable, "-m", "tiercache", "vllm-tier", *args], capture_output=True, text=True,
                             timeout=60, env=python_env())
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_plugin_entry_point_never_raises_without_vllm():
    """vLLM runs every `vllm.general_plugins` entry point in each of its processes: one that raised would stop vLLM
    from starting. Here no vLLM is installed: registering is a no-op (tests/vllm/test_tier.py registers for real)."""
    from tiercache.connector.vllm_tier.plugin import register

    register()
    register()


def test_a_named_attention_backend_goes_into_the_entry(tmp_path):
    from tiercache.cli.vllm_tier import tier_entry

    (tmp_path / "config.json").write_text("{}")
    assert "attention_backend" not in tier_entry(str(tmp_path), [], "grpc://127.0.0.1:9")
    entry = tier_entry(str(tmp_path), ["--attention-backend", "FLASHINFER"], "grpc://127.0.0.1:9")
    assert entry["attention_backend"] == "FLASHINFER"
    assert TierSettings.from_tier_kwargs({k: v for k, v in entry.items()
                                          if k not in ("type", "module_path")}).attention_backend == "FLASHINFER"
