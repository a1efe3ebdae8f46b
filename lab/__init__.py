"""The serving lab: tiercache measured beside real engines, never shipped (the package never imports it;
tests/test_architecture.py holds that line). Each entry is a module run from the checkout's root, so that the checkout's
own tiercache, lab and testkit are imported (`python -m` puts the working directory first on sys.path):

    python -m lab.serve_trace     real vLLM OpenAI servers replaying the Mooncake conversation trace, arm by arm
    python -m lab.chat_rounds     closed-loop multi-round chat on the same servers
    python -m lab.fleet_trace     engines behind an event-driven router, per routing policy
    python -m lab.tier_bandwidth  vLLM's offloading tiers' store and load bandwidth, vLLM's fs tier against tiercache

Their parts: `serving/` (engines, arms, the replay, the report and its statistics, the runs' provenance), `chat/`
(the closed loop and its report), `fleet/` (router, pods, their clocks); `common`: what every benchmark writes the
same way (percentiles, a report's provenance and JSON, plots), the package's micro-benchmarks too; `layouts`: the
small model shape simulated engines run. The micro-benchmarks are benchmarks/ (`python -m benchmarks.<name>`); what
the lab shares with the tests is testkit/; the lab's own tests are lab/tests (`make lab-smoke`). docs/benchmarks.md
has the commands and the results.
"""
