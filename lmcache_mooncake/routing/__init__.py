"""The prefill/decode proxy: the command, its HTTP app, its routing, and what routing needs.

- :mod:`~lmcache_mooncake.routing.proxy`: ``lmcache-mooncake proxy`` (flags, start-up).
- :mod:`~lmcache_mooncake.routing.app`: the FastAPI app and its lifespan.
- :mod:`~lmcache_mooncake.routing.router`: :class:`ProxyConfig` and the work of each
  endpoint (intake, prefill or direct decode, decode as JSON or a stream).
- :mod:`~lmcache_mooncake.routing.relay`: the SSE relay and the client-disconnect race.
- :mod:`~lmcache_mooncake.routing.intake`: read and check a client's request
  (size limit, read timeout, JSON, required fields) before anything is sent on.
- :mod:`~lmcache_mooncake.routing.errors`: OpenAI-style errors for failed
  instances (unreachable, timed out, HTTP errors, broken streams).
- :mod:`~lmcache_mooncake.routing.pool`: the instances of one role, their
  health (checked with back-off) and their outstanding requests.
- :mod:`~lmcache_mooncake.routing.placement`: which instance should serve a
  prompt: rendezvous hashing of its first chunk key, or round-robin, with a
  load bound.
- :mod:`~lmcache_mooncake.routing.prompt_keys`: a prompt's chunk keys as the
  connector's worker names them (vLLM's renderer and :mod:`lmcache_mooncake.chunks.keys`),
  and how many of its tokens the store already holds.
"""
