"""Prompts for the tiny models the real-engine tests and the lab write (testkit/vllm_models.py, the SGLang engine's
testkit/sglang_models.py): token ids drawn from a seed, never one of the models' special tokens (ids 0, 1, 2: <unk>,
BOS, EOS), so a prompt neither starts nor ends a sequence by accident."""

from __future__ import annotations

import numpy as np

VOCAB = 1024  # every tiny model's vocabulary
FIRST_ORDINARY = 3  # the first id that is no special token


def prompt(seed: int, length: int) -> list[int]:
    """`length` token ids in [FIRST_ORDINARY, VOCAB), the same for the same seed in every process."""
    return np.random.default_rng(seed).integers(FIRST_ORDINARY, VOCAB, length).tolist()
