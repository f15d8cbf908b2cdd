"""``python -m lmcache_mooncake.warmup``: the same as ``lmcache-mooncake warmup``."""

import sys

from lmcache_mooncake.warmup.cli import main_warmup

sys.exit(main_warmup())
