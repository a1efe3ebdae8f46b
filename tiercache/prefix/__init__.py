"""The prefix library: pure rules, shared by the connectors (client side) and the server's Lookup.

`hashes` (chain hashes of token prefixes), `layout` (a model's layer groups and bytes), `presets` (known models),
`hf_config` (a layout from a model's config.json), `block_size` (vLLM's N for it, before a start), `objects` (kv / tail
/ state objects and their keys), `hit` (the hit rule), `admission` (what a request saves),
`lookup` (the search behind the Lookup call). No I/O: it imports only `errors` and `record`."""
