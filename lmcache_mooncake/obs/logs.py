"""Our log lines in vLLM's output.

vLLM configures only its own ``vllm`` logger, so without this our INFO lines
(what was loaded, stored, recomputed) would be dropped in vLLM processes.
``LMCACHE_MOONCAKE_LOG_LEVEL`` sets the level (default INFO).
"""

from __future__ import annotations

import logging
import os

_FORMAT = "(lmcache-mooncake) %(levelname)s %(asctime)s [%(name)s] %(message)s"


def setup_logging() -> None:
    """Give the ``lmcache_mooncake`` logger a stderr handler once per process."""
    log = logging.getLogger("lmcache_mooncake")
    if getattr(log, "_lmcm_configured", False):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT, "%m-%d %H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("LMCACHE_MOONCAKE_LOG_LEVEL", "INFO").upper())
    log.propagate = False
    log._lmcm_configured = True  # type: ignore[attr-defined]
