"""Tiny random-weight models the real-engine tests write themselves (nothing comes from a hub): hybrids, and one
dense model for the gates that must hold without recurrent states too.

Each config is one vLLM CPU runs: Gated-DeltaNet + full attention (Qwen3-Next), bf16 (the CPU GDN kernel needs it),
head_dim a multiple of 32 (the CPU attention kernel's). vLLM picks the unified block size N from the page sizes, and
the state's dtype, so N, from the CPU it runs on: `block_size` below is tiercache's prediction for the CPU the engines
see (testkit/cpu_stand_in), which tests/vllm_engine/test_block_size.py checks against the engine's own start line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from testkit.prompts import VOCAB


@dataclass(frozen=True)
class TinyModel:
    name: str
    layers: int
    full_attention_interval: int
    kv_heads: int
    head_dim: int
    seed: int = 0
    hybrid = True

    @property
    def block_size(self) -> int:
        """N as vLLM's CPU engine derives it for this config on the engines' CPU (prefix.block_size)."""
        return self.sizing().block_tokens

    def sizing(self, cpu_level: str | None = None):
        from testkit.cpu_stand_in import engine_cpu
        from tiercache.prefix.block_size import PLATFORMS, engine_sizing

        return engine_sizing(self.config_fields(), self.name, platform=PLATFORMS["cpu"], cpu=engine_cpu(cpu_level))

    def config_fields(self) -> dict:
        """The config.json fields that decide N, as transformers writes them for this model (tiercache reads them)."""
        return {"model_type": "qwen3_next", "num_hidden_layers": self.layers,
                "layer_types": ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                                for i in range(self.layers)],
                "num_attention_heads": 4, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "dtype": "bfloat16"}

    def write(self, directory: Path) -> str:
        path = directory / self.name
        if not (path / "config.json").exists():
            self.write_to(path)
        return str(path)

    def write_to(self, path: Path, seed: int | None = None) -> str:
        """Save the model's weights (random, from `seed`, default the model's own) into `path`, replacing any."""
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        torch.manual_seed(self.seed if seed is None else seed)
        config = Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=self.layers,
            num_attention_heads=4, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, full_attention_interval=self.full_attention_interval, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            decoder_sparse_step=1, max_position_embeddings=32768, eos_token_id=2, bos_token_id=1,
            torch_dtype="bfloat16")
        Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        return str(path)


# Two shapes so that no criterion holds for one config only (4 layers, GDN/attention alternating, 2 KV heads; 6 layers,
# two GDN per attention layer, 4 KV heads of 128). With AVX-512 BF16 (a float32 state) their N are 256 and 128;
# without it (a bf16 state), 128 and 128 (tests/prefix/test_block_size.py).
FOUR_LAYER = TinyModel("qwen3-next-4l", layers=4, full_attention_interval=2, kv_heads=2, head_dim=64)
SIX_LAYER = TinyModel("qwen3-next-6l", layers=6, full_attention_interval=3, kv_heads=4, head_dim=128, seed=1)


@dataclass(frozen=True)
class TinyDense:
    """A dense Qwen3 (attention only): no recurrent state, N is vLLM's block size (engine option block_size; the CPU
    attention backend takes multiples of 32)."""

    name: str = "qwen3-dense-2l"
    block_size: int = 64
    seed: int = 2
    hybrid = False

    def write(self, directory: Path) -> str:
        path = directory / self.name
        if not (path / "config.json").exists():
            import torch
            from transformers import Qwen3Config, Qwen3ForCausalLM

            torch.manual_seed(self.seed)
            config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 max_position_embeddings=32768, eos_token_id=2, bos_token_id=1,
                                 torch_dtype="bfloat16")
            Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        return str(path)


DENSE = TinyDense()
