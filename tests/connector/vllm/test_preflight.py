"""The vLLM connector's refusals before the engine core starts (tiercache.connector.vllm.preflight): each one line,
in the connector's words, for the configurations it cannot serve; found on the stack while vLLM validates its config
(the early hook), and said again by the constructor. (On vLLM's real engine: tests/vllm_engine/test_early_refusals.py.)
These run without vLLM: a stand-in `VllmConfig` has the attributes the checks read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiercache.connector.vllm.preflight import EngineChoices, choices_of, refuse, refuse_early, refusals
from tiercache.errors import InvalidArgument

GOOD = EngineChoices(vllm_version="0.32.0", extra_config={"url": "grpc://127.0.0.1:1"}, hybrid=True)


def test_a_configuration_the_connector_serves_has_no_refusal():
    assert refusals(GOOD) == []
    refuse(GOOD)
    assert refusals(EngineChoices("0.33.0", mamba_cache_mode="none")) == []  # no Mamba groups: the mode is moot


@pytest.mark.parametrize("change,start", [
    ({"mamba_cache_mode": "none"}, "TierCacheConnector needs vLLM's Mamba cache mode 'align', got 'none'"),
    ({"extra_config": {"urll": "grpc://h:1"}}, "unknown kv_connector_extra_config keys for TierCacheConnector: urll"),
    ({"mamba_speculative_blocks": 2}, "TierCacheConnector does not support speculative decoding on Mamba groups"),
    ({"hybrid": False, "attention_free": True}, "TierCacheConnector needs attention layers"),
    ({"hybrid": False, "mla": True}, "TierCacheConnector supports plain K/V attention pages, not MLA"),
])
def test_each_refusal_is_one_line(change, start):
    choices = EngineChoices(**{**vars(GOOD), **change})
    [line] = refusals(choices)
    assert line.startswith(start) and "\n" not in line
    with pytest.raises(InvalidArgument, match="^" + start.replace("(", r"\(")):
        refuse(choices)


def _vllm_config(prefix_caching: bool, extra: dict | None = None):
    """A stand-in for vLLM's VllmConfig, as its __post_init__ leaves it for the hook (vLLM's class name and module,
    which is how the hook knows it)."""
    model = SimpleNamespace(is_hybrid=True, is_attention_free=False, use_mla=False)
    cache = SimpleNamespace(mamba_cache_mode="align" if prefix_caching else "none", use_replayssm=False)
    transfer = SimpleNamespace(kv_connector_extra_config=extra or {"url": "grpc://127.0.0.1:1"})
    return SimpleNamespace(model_config=model, cache_config=cache, kv_transfer_config=transfer,
                           num_speculative_tokens=0)


class VllmConfig:
    """Resolves the connector class in its __post_init__, as vLLM's does (KVConnectorFactory.get_connector_class)."""

    __module__ = "vllm.config.vllm"

    def __init__(self, values) -> None:
        vars(self).update(vars(values))
        self.__post_init__()

    def __post_init__(self) -> None:
        import tiercache.connector.vllm as package

        getattr(package, "TierCacheConnector")


def test_resolving_the_class_while_vllm_validates_its_config_refuses_it():
    with pytest.raises(InvalidArgument, match="Mamba cache mode 'align', got 'none'"):
        VllmConfig(_vllm_config(prefix_caching=False))
    with pytest.raises(InvalidArgument, match="unknown kv_connector_extra_config keys for TierCacheConnector: urll"):
        VllmConfig(_vllm_config(prefix_caching=True, extra={"urll": 1}))


def test_the_hook_checks_nothing_outside_a_config_being_validated():
    refuse_early()  # no VllmConfig on the stack: the constructor checks later

    class NotVllm:
        __module__ = "myapp"

        def __post_init__(self) -> None:
            refuse_early()

    NotVllm().__post_init__()


def test_choices_of_a_config_are_what_its_hooks_left():
    choices = choices_of(_vllm_config(prefix_caching=False))
    assert (choices.hybrid, choices.mamba_cache_mode, choices.mamba_speculative_blocks) == (True, "none", 0)
    replay = _vllm_config(prefix_caching=True)
    replay.num_speculative_tokens, replay.cache_config.use_replayssm = 3, True
    assert choices_of(replay).mamba_speculative_blocks == 0  # ReplaySSM writes no per-draft state slots
