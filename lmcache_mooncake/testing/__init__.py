"""What tests, the demos and the benchmarks use to run the product; not the serving path.

- :mod:`lmcache_mooncake.testing.models`: deterministic, hub-free model folders
  (``lmcache-mooncake make-model``).
- :mod:`lmcache_mooncake.testing.offline`: a vLLM instance in a child process
  that runs batches of prompts and exits (``run_instance``, ``Instance``).
- :mod:`lmcache_mooncake.testing.prompts`: the demo prompts.

Installed with the package because ``make-model``, ``demo``, ``up --demo`` and
``warmup`` (its producer) use them; vLLM processes serving traffic never
import them.
"""
