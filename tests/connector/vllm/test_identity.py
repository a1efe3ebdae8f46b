"""The weights' identity that goes into a vLLM engine's namespace (tiercache.connector.vllm.identity): read from the
files, remembered across starts, and the hub's content-named blobs used as they are."""

from __future__ import annotations

import json
import os

from tiercache.connector.vllm.identity import model_directory, weights_identity


def _model(directory, weights: bytes, config: str = '{"hidden_size": 64}'):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "README.md").write_text("not part of the identity")
    return directory


def test_other_weights_or_config_at_the_same_path_are_another_identity(tmp_path):
    memo = tmp_path / "memo.json"
    model = _model(tmp_path / "model", b"\x01" * 1000)
    first = weights_identity(model, memo)
    (model / "README.md").write_text("edited")
    assert weights_identity(model, memo) == first
    _model(model, b"\x01" * 999 + b"\x02")
    second = weights_identity(model, memo)
    assert second != first
    _model(model, b"\x01" * 999 + b"\x02", config='{"hidden_size": 128}')
    assert weights_identity(model, memo) not in (first, second)


def test_the_same_files_elsewhere_are_the_same_identity(tmp_path):
    memo = tmp_path / "memo.json"
    assert weights_identity(_model(tmp_path / "a", b"w" * 4096), memo) == \
        weights_identity(_model(tmp_path / "b", b"w" * 4096), memo)


def test_hashes_are_remembered_by_path_size_mtime_and_inode(tmp_path):
    memo = tmp_path / "memo.json"
    model = _model(tmp_path / "model", b"x" * 4096)
    identity = weights_identity(model, memo)
    remembered = json.loads(memo.read_text())
    assert len(remembered) == 2  # config.json and the weights
    # A remembered hash is trusted while the file's stat matches: a planted marker proves the file is not read.
    weights_key = next(k for k in remembered if k.startswith(str((model / "model.safetensors").resolve()) + "|"))
    memo.write_text(json.dumps({**remembered, weights_key: "marker"}))
    assert weights_identity(model, memo) != identity
    # Once the file's stat changes (a new mtime), it is hashed again.
    os.utime(model / "model.safetensors", ns=(1, 1))
    assert weights_identity(model, memo) == identity


def test_hub_blobs_are_named_by_their_content_hash_and_not_read(tmp_path):
    memo = tmp_path / "memo.json"
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    snapshot = tmp_path / "hub" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for name, blob in [("config.json", "c0ffee"), ("model.safetensors", "5ha256")]:
        (blobs / blob).write_bytes(b"content")
        (snapshot / name).symlink_to(blobs / blob)
    identity = weights_identity(snapshot, memo)
    assert not memo.exists()  # nothing was hashed
    (blobs / "5ha256").write_bytes(b"other content")  # a blob's name is its content: not read again
    assert weights_identity(snapshot, memo) == identity


def test_model_directory_is_the_path_or_none_without_a_cached_snapshot(tmp_path):
    assert model_directory(str(tmp_path), None) == tmp_path
    assert model_directory("no-such-org/no-such-model-xyz", "main") is None


# -- the model identity both of tiercache's vLLM parts name (the connector from vLLM's config, the secondary tier from
# `tiercache vllm-tier`): one function, so one answer for the same model and flags.

def _engine_config(model_dir, hf_overrides=None, quantization=None, cache_dtype="auto"):
    """What engine_model_identity reads of vLLM's config (the attributes it names, as vLLM 0.32 and 0.33 have them)."""
    from types import SimpleNamespace

    model = SimpleNamespace(model=str(model_dir), revision=None, quantization=quantization, hf_overrides=hf_overrides)
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=cache_dtype))


ROPE = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def test_the_connector_and_the_tier_name_the_same_model_and_flags_alike(tmp_path):
    from tiercache.cli.vllm_tier import tier_entry
    from tiercache.connector.vllm.identity import engine_model_identity

    model = _model(tmp_path / "model", b"\x07" * 512)
    for flags, config in [([], _engine_config(model)),
                          (["--hf-overrides", json.dumps(ROPE)], _engine_config(model, hf_overrides=ROPE)),
                          (["--kv-cache-dtype", "fp8_e5m2"], _engine_config(model, cache_dtype="fp8_e5m2")),
                          (["-q", "fp8"], _engine_config(model, quantization="fp8"))]:
        assert tier_entry(str(model), flags, "grpc://127.0.0.1:1")["model_identity"] == \
            engine_model_identity(config), flags


def test_a_rope_override_or_another_kv_dtype_is_another_identity_for_both(tmp_path):
    from tiercache.cli.vllm_tier import tier_entry
    from tiercache.connector.vllm.identity import engine_model_identity

    model = _model(tmp_path / "model", b"\x07" * 512)
    plain = engine_model_identity(_engine_config(model))
    assert len({plain, engine_model_identity(_engine_config(model, hf_overrides=ROPE)),
                engine_model_identity(_engine_config(model, cache_dtype="fp8_e4m3")),
                engine_model_identity(_engine_config(model, cache_dtype="fp8_e5m2"))}) == 4
    scaled = {"rope_parameters": {**ROPE["rope_parameters"], "factor": 2.0}}
    entries = {tier_entry(str(model), flags, "grpc://127.0.0.1:1")["model_identity"]
               for flags in ([], ["--hf-overrides", json.dumps(ROPE)], ["--hf-overrides", json.dumps(scaled)])}
    assert len(entries) == 3
    # The same overrides written in another key order are the same identity.
    reordered = json.dumps({"rope_parameters": dict(reversed(list(ROPE["rope_parameters"].items())))})
    assert tier_entry(str(model), ["--hf_overrides=" + reordered], "grpc://127.0.0.1:1")["model_identity"] == \
        engine_model_identity(_engine_config(model, hf_overrides=ROPE))
