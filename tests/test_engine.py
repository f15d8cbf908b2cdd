"""LMCache's engine with our copier, keys and disk tier, without vLLM (checks in engine_checks.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


# The keys of engine_checks.CHECKS (not imported here: that would load LMCache in this process).
@pytest.mark.parametrize("name", ["damaged_file_stops_the_lookup_prefix", "store_then_fresh_engine_loads_bit_exact"])
def test_engine_check(name):
    # A fresh process per check: see engine_checks.py for why.
    out = subprocess.run([sys.executable, str(HERE / "engine_checks.py"), name],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
