"""The two gates of the SGLang real-engine hit tests, both exact (==, no tolerance), and what they compare. Each is
shown to fail on the faults it is meant to catch in test_planted_faults.py.

- outputs: the judged request returns what the reference request returns (SGLang's own device hit at the same
  position): the greedy tokens, each token's logprob and its top-20 logprobs (exact floats) of OUTPUT_TOKENS
  generated tokens, and the prompt logprobs of the part the engine computed after the hit (SGLang returns prompt
  logprobs only from where its prefix match stops, so a test asks for them from the hit's end).
- engine bytes: the request's KV pages (every attention layer, K and V, page by page, through SGLang's own
  request-to-token table) and the Mamba state it started from and ended with, as SGLang's device pools held them
  (testkit/sglang_site/probe.py), equal by sha256 to the reference request's. It sees what the outputs cannot: a fault
  the model does not show in 16 tokens (test_planted_faults.py: two pages swapped, which attention sums over in any
  order).
"""

from __future__ import annotations

from testkit.sglang_engine import Completion

OUTPUT_TOKENS = 16
TOP_LOGPROBS = 20
OUTPUTS = "outputs"
ENGINE_BYTES = "engine bytes"


def output_differences(judged: Completion, reference: Completion) -> list[str]:
    """What the judged request returned that the reference did not, by ==; [] when identical."""
    assert len(reference.tokens) >= OUTPUT_TOKENS and all(len(top) == TOP_LOGPROBS for top in reference.top), \
        "the reference returned fewer tokens or logprobs than a gate compares"
    fields = {"tokens": (judged.tokens, reference.tokens),
              "output logprobs": (judged.output, reference.output),
              "top-20 logprobs": (judged.top, reference.top),
              "prompt logprobs": (judged.input, reference.input)}
    differences = []
    for name, (got, expected) in fields.items():
        if got != expected:
            at = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), min(len(got), len(expected)))
            differences.append(f"{name} from #{at}")
    return differences


def kv_differences(judged: dict, reference: dict, pages: slice = slice(None)) -> list[str]:
    """Per KV layer group ("k0", "v0", ...), the first page within `pages` where the judged request's engine bytes
    differ from the reference's, and how many more do; [] when identical."""
    if judged["kv"].keys() != reference["kv"].keys():
        return [f"layer groups {sorted(judged['kv'])} vs {sorted(reference['kv'])}"]
    differences = []
    for group, hashes in judged["kv"].items():
        got, expected = hashes[pages], reference["kv"][group][pages]
        wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
        if len(got) != len(expected):
            differences.append(f"{group}: {len(got)} pages vs {len(expected)}")
        elif wrong:
            differences.append(f"{group}: page {wrong[0] + (pages.start or 0)} and {len(wrong) - 1} more")
    return differences


def state_differences(got: dict | None, expected: dict | None, moment: str) -> list[str]:
    """The Mamba state groups ("conv0.<layer>", "temporal.<layer>") that differ; [] when identical."""
    if got == expected:
        return []
    if got is None or expected is None:
        return [f"{moment}: {'none' if got is None else 'a state'} vs {'none' if expected is None else 'a state'}"]
    return [f"{moment}: {sorted(k for k in got if got[k] != expected.get(k))}"]


def byte_differences(judged: dict, reference: dict) -> list[str]:
    """Every KV page, the Mamba state at the request's start and at its end: where they differ; [] when identical."""
    return (kv_differences(judged, reference) + state_differences(judged["state_start"], reference["state_start"],
                                                                  "state_start")
            + state_differences(judged["state_end"], reference["state_end"], "state_end"))


def gate_failures(judged: Completion, reference: Completion) -> dict[str, list[str]]:
    """{gate: its differences} for both gates (an empty list: the gate passes)."""
    assert judged.engine_bytes is not None and reference.engine_bytes is not None, "a request without its bytes"
    return {OUTPUTS: output_differences(judged, reference),
            ENGINE_BYTES: byte_differences(judged.engine_bytes, reference.engine_bytes)}


def assert_exact(judged: Completion, reference: Completion, what: str) -> None:
    """Both gates pass: `judged` is `reference`, output for output and byte for byte."""
    failures = {gate: found for gate, found in gate_failures(judged, reference).items() if found}
    assert not failures, f"{what}: {failures}"
