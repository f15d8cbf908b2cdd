# The README's two commands: `make demo` and `make test`. Each sets itself up.
.PHONY: setup test demo demo-single bench lint clean

setup:
	@bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest

# The main job: store, prefill and decode vLLM and the proxy on this host, demo
# requests through the proxy, a table, then everything is stopped.
demo: setup
	.venv/bin/lmcache-mooncake up --demo

# One vLLM instance run twice (disk tier only): the core connector on its own.
demo-single: setup
	.venv/bin/lmcache-mooncake demo

# The benchmarks behind docs/performance.md (about 30 minutes on 2 cores from a
# fresh clone, setup included; slower VMs took longer); results and plots go to
# benchmarks/results/. docs/performance.md lists the slower variants they offer
# (tier_load.py --paths worker,lmcache, --auth).
bench: setup
	.venv/bin/python benchmarks/layout_copy.py
	.venv/bin/python benchmarks/tier_load.py
	.venv/bin/python benchmarks/ttft.py --profile
	.venv/bin/python benchmarks/store_throughput.py
	.venv/bin/python benchmarks/warmup_throughput.py
	.venv/bin/python benchmarks/routing.py
	.venv/bin/python benchmarks/serving.py
	.venv/bin/python benchmarks/report.py

lint: setup
	.venv/bin/ruff check lmcache_mooncake tests benchmarks

clean:
	rm -rf .venv .pytest_cache
