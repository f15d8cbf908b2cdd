# The README's two commands: `make demo` and `make test`. Each sets itself up.
.PHONY: setup test demo lint clean

setup:
	@bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest

demo: setup
	.venv/bin/lmcache-mooncake demo

lint: setup
	.venv/bin/ruff check lmcache_mooncake tests benchmarks

clean:
	rm -rf .venv .pytest_cache
