"""Observability: engine counters, vLLM metrics and their names, KV events, stats files, the /metrics reader, logging."""
