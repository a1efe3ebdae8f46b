"""KV events for routers (issue 27): which attention blocks each engine instance (a pod) can restore from this
server (`restorable`), published in vLLM's KV-event wire format over ZMQ (`vllm_wire`, `publisher`)."""
