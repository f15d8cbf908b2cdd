"""lmcache-mooncake: share vLLM KV cache between instances through LMCache
tiers (CPU, disk) and a Mooncake Store, by content-hashed chunks."""

__version__ = "0.1.0"
