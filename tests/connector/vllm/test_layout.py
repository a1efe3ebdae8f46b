"""The vLLM connector's refusal of an engine whose Mamba groups are not in align mode: vLLM 0.32 and 0.33 both derive
the mode from prefix caching, 0.33 deprecated --mamba-cache-mode, so the message names --enable-prefix-caching and
says what the flag does on the version running. (On vLLM's real engine: tests/vllm_engine/test_startup_refusals.py.)"""

from __future__ import annotations

import pytest

from tiercache.connector.vllm.layout import mamba_mode_refusal


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1.dev4+g123"])
def test_an_engine_without_align_mode_is_told_what_its_vllm_version_needs(version):
    message = mamba_mode_refusal("none", version)
    assert "\n" not in message
    assert message.startswith("TierCacheConnector needs vLLM's Mamba cache mode 'align', got 'none'")
    assert "start vLLM with --enable-prefix-caching" in message and f"vLLM {version}" in message
    assert "--mamba-cache-mode align)" not in message  # never told to pass the flag as the fix
    if version.startswith("0.32"):
        assert "--mamba-cache-mode align without prefix caching is turned back to 'none'" in message
    else:
        assert "--mamba-cache-mode is deprecated and has no effect" in message
