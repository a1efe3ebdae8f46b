"""The suite's engines are forked from one process that imported vLLM once (testkit/vllm_zygote.py): a forked engine
answers exactly as one started from scratch, and exits as one does; an engine whose environment differs is started
from scratch and says why."""

from __future__ import annotations

import subprocess

from testkit.prompts import prompt
from testkit.vllm_zygote import ForkedProcess


def test_a_forked_engine_computes_as_one_started_from_scratch_and_exits_cleanly(four_layer, engine_zygote,
                                                                                monkeypatch):
    # What importing vLLM sets in a process's environment, as once a test has imported it here: still forked.
    for name, value in engine_zygote.set_at_import.items():
        monkeypatch.setenv(name, value)
    forked = four_layer.start("forked", None)
    monkeypatch.setenv("TIERCACHE_TEST_NOT_FORKED", "1")  # a variable the zygote's vLLM did not import with
    scratch = four_layer.start("from-scratch", None)
    assert isinstance(forked.process, ForkedProcess) and isinstance(scratch.process, subprocess.Popen)
    assert ("not forked: its environment differs from the zygote's in TIERCACHE_TEST_NOT_FORKED"
            in scratch.log_path.read_text())
    tokens = prompt(900, 3 * four_layer.n + 40)
    from_fork, from_scratch = forked.one(tokens), scratch.one(tokens)
    # Tokens, logprobs of every generated token and of every prompt position, the bytes the engine computed from.
    assert from_fork == from_scratch and len(from_fork.tokens) == 16
    assert forked.one(tokens) == scratch.one(tokens)  # and again, from each engine's own prefix cache
    forked.close()
    assert forked.process.returncode == 0, forked.log_tail()
