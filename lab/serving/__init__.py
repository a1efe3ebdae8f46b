"""The serving benchmark's parts (lab/serve_trace.py): a production trace turned into token-id requests, real
OpenAI-compatible vLLM servers and tiercache servers, an open-loop streaming client, and the report."""
