"""KV events for routers (docs/events.md): which attention blocks each engine instance (a pod) can restore from this
server (`restorable`, which redoes a pod's block trees with `recompute`), published in vLLM's KV-event wire format
over ZMQ (`vllm_wire`, `publisher`); and, for routers that read no events, the pod query (`query`): a prompt's
restorable hit per pod and tier."""
