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
