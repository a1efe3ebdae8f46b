"""Does compression pay? lz4 (with and without byte shuffle) on KV and state payloads of a transformers hybrid model.

Builds the demo's Qwen3.5-architecture model in bfloat16 (random weights: nothing is downloaded, so real weights may
compress somewhat differently), runs a prompt, cuts kv and state objects out of its cache exactly as the connector
does, and reports per codec: ratio, compression and decompression GB/s, and whether writing compressed bytes to
disk would beat writing raw bytes at the file-write speed measured in the same run.

    .venv/bin/python -m benchmarks.codec [--tokens 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from tiercache.connector.hf.cache import attention_payload, derive_layout, state_payload
from tiercache.demo import qwen35_model
from tiercache.record import codec


def write_gbps(data: bytes) -> float:
    with tempfile.NamedTemporaryFile() as f:
        started = time.perf_counter()
        for _ in range(8):
            f.seek(0)
            f.write(data)
        f.flush()
        return 8 * len(data) / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    model = qwen35_model(hidden=512, layers=8).to(torch.bfloat16)
    layout = derive_layout(model, "bench/codec", "random")
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, model.config.vocab_size, args.tokens))[None]
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    payloads = {
        "kv (bf16)": attention_payload(cache, layout.attention_groups[0], 0, args.tokens).tobytes(),
        "state (bf16 conv + fp32 ssm)": state_payload(cache, layout.recurrent_group).tobytes(),
    }
    disk = write_gbps(payloads["kv (bf16)"])
    print(f"raw file write: {disk:.2f} GB/s")
    print(f"{'object':<30}{'codec':<14}{'ratio':>7}{'comp GB/s':>11}{'decomp GB/s':>13}  pays on disk?")
    for name, data in payloads.items():
        for codec_name in ("lz4", "lz4-shuffle2", "lz4-shuffle4"):
            c = codec.codec_id(codec_name)
            started = time.perf_counter()
            packed = codec.compress(c, data)
            middle = time.perf_counter()
            assert codec.decompress(c, packed) == data
            ended = time.perf_counter()
            ratio = len(data) / len(packed)
            comp, decomp = len(data) / (middle - started) / 1e9, len(data) / (ended - middle) / 1e9
            pays = 1 / comp + 1 / (ratio * disk) < 1 / disk  # compress + write less vs write all
            print(f"{name:<30}{codec_name:<14}{ratio:>7.2f}{comp:>11.2f}{decomp:>13.2f}  {'yes' if pays else 'no'}")


if __name__ == "__main__":
    main()
