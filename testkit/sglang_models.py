"""Tiny random-weight models the SGLang engine tests and benchmarks/sglang_backend.py write themselves, with a tokenizer
trained here (nothing comes from a hub): Qwen3 (dense attention) and Qwen3-Next (Gated-DeltaNet + attention, SGLang's
hybrid Mamba path).

bf16 weights, vocabulary 1024: the tokenizer is a byte-level BPE trained on a generated corpus to exactly that size,
with <unk>, <s>, </s> at ids 0, 1, 2 (the models' BOS and EOS). Tests pass token ids, so the tokenizer only has to
load and be SGLang's (SGLang starts its tokenizer manager and detokenizer from the model folder).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from testkit.prompts import VOCAB
SPECIAL = ["<unk>", "<s>", "</s>"]
FULL_ATTENTION_INTERVAL = 2  # hybrid: GDN, attention, GDN, attention


@dataclass(frozen=True)
class TinyModel:
    name: str
    kind: str  # "dense" (Qwen3ForCausalLM) or "hybrid" (Qwen3NextForCausalLM)
    layers: int
    seed: int = 0
    hidden: int = 256  # attention heads of 64, MLP twice as wide

    def write(self, directory: Path) -> str:
        """The model's folder under `directory`, written on first use (weights, config, tokenizer)."""
        path = directory / self.name
        if not (path / "config.json").exists():
            import torch

            torch.manual_seed(self.seed)
            model = self._model()
            model.to(torch.bfloat16).save_pretrained(path)
            if self.kind == "hybrid":
                # transformers 5 writes the layer pattern as `layer_types`; SGLang's Qwen3NextConfig reads
                # `full_attention_interval` (as in the published Qwen3-Next configs).
                config = json.loads((path / "config.json").read_text())
                config["full_attention_interval"] = FULL_ATTENTION_INTERVAL
                (path / "config.json").write_text(json.dumps(config, indent=2))
            write_tokenizer(path)
        return str(path)

    def _model(self):
        common = dict(vocab_size=VOCAB, hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                      num_hidden_layers=self.layers, num_attention_heads=self.hidden // 64, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
        if self.kind == "dense":
            from transformers import Qwen3Config, Qwen3ForCausalLM

            return Qwen3ForCausalLM(Qwen3Config(**common))
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            **common, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=FULL_ATTENTION_INTERVAL,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            decoder_sparse_step=1)
        return Qwen3NextForCausalLM(config)


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE of VOCAB tokens trained on a generated corpus, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    corpus = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(12))
              for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


DENSE = TinyModel("qwen3-tiny", "dense", layers=2)
HYBRID = TinyModel("qwen3-next-tiny", "hybrid", layers=4)


def transformers_greedy(path: str, tokens: list[int], steps: int) -> list[tuple[int, float]]:
    """(token, logprob) of `steps` greedy tokens after `tokens`, computed by transformers' own implementation of the
    model (its pure-torch Gated-DeltaNet for Qwen3-Next): what SGLang's engine with testkit/sglang_site must compute."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    picked = out.sequences[0, len(tokens):].tolist()
    return [(token, float(torch.log_softmax(logits[0].float(), -1)[token]))
            for token, logits in zip(picked, out.logits)]
