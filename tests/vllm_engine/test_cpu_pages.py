"""CPU engines on hosts of two kinds never share attention pages. vLLM's CPU attention lays K/V out for AMX tiles on
a CPU with AMX and otherwise not ("vec"), in pages of the same size: on an AVX-512 BF16 CPU with AMX and on one
without (a Zen 4), the 4-layer model gets the same N and dtypes, so only the page layout the connector puts in its
namespace (connector/vllm/identity.page_layout) keeps the two apart. This machine runs one engine as it is and one
with AVX-512 BF16 but no AMX stood in (testkit/cpu_stand_in).

The planted fault: two more engines, one of each CPU, with the layout left out of the namespace (unnamed_pages,
testkit/vllm_engine_process.py). The one without AMX then loads the other's pages, and the engine bytes gate
(its blocks against vLLM's own hit of the same prefix on that CPU) fails: that is what the namespace term prevents.
"""

from __future__ import annotations

import os
import re

import pytest

from testkit.cpu_stand_in import ENV
from testkit.prompts import prompt
from tests.vllm_engine.gates import assert_same_bytes
from tiercache.prefix.cpu_features import detect

NO_AMX = "avx512_bf16"

pytestmark = pytest.mark.skipif(not detect().amx or bool(os.environ.get(ENV)),
                                reason="needs a CPU with AMX, not stood in, to stand in one without it")


def _start_line(engines, name: str) -> tuple[str, int]:
    text = (engines.logs / f"{engines.model.name}-{name}.log").read_text(errors="replace")
    started = re.search(r"TierCacheConnector \(SCHEDULER\) on \S+: namespace (\S+), N=(\d+),", text)
    assert started, text[-3000:]
    return started.group(1), int(started.group(2))


@pytest.mark.timeout(1200)  # four engine starts on a shared CI machine
def test_engines_whose_attention_pages_differ_get_the_same_n_and_never_each_others_pages(four_layer, cache_server):
    amx = four_layer.start("pages-amx", cache_server.url)
    vec = four_layer.start("pages-vec", cache_server.url, cpu_level=NO_AMX)
    (amx_namespace, amx_n), (vec_namespace, vec_n) = _start_line(four_layer, "pages-amx"), \
        _start_line(four_layer, "pages-vec")
    assert amx_n == vec_n == four_layer.n and amx_namespace != vec_namespace
    tokens = prompt(5100, 3 * four_layer.n + 40)
    amx.one(tokens, max_tokens=1)  # saved to tiercache under the AMX engine's namespace
    assert vec.one(tokens, max_tokens=1).cached == 0
    amx.close()

    # The planted fault: the layout left out of both namespaces. The engine without AMX now loads the AMX engine's
    # pages; `vec` (the same CPU, its own pages) computes the same prompt and hits it in its own prefix cache.
    producer = four_layer.start("unnamed-amx", cache_server.url, unnamed_pages=True)
    judged = four_layer.start("unnamed-vec", cache_server.url, cpu_level=NO_AMX, unnamed_pages=True)
    assert _start_line(four_layer, "unnamed-amx")[0] == _start_line(four_layer, "unnamed-vec")[0]
    tokens = prompt(5101, 3 * four_layer.n + 40)
    hit = (len(tokens) - 1) // four_layer.unit * four_layer.unit
    producer.one(tokens, max_tokens=1)
    vec.one(tokens, max_tokens=1)
    own = vec.one(tokens)  # vLLM's own hit on the CPU without AMX: its own pages
    got = judged.one(tokens)  # the AMX engine's pages, loaded
    assert own.cached == got.cached == hit
    with pytest.raises(AssertionError, match="hold other bytes"):
        assert_same_bytes(got, own, "pages of the other kernel")
    for ours, yardstick in zip(got.engine_bytes["groups"], own.engine_bytes["groups"], strict=True):
        if ours["kind"] != "mamba":  # every attention page of the prefix holds other bytes
            assert all(a != b for a, b in zip(ours["blocks"], yardstick["blocks"], strict=True)), ours["kind"]
