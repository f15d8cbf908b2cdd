"""LMCache's engine with our copier, keys and disk tier, without vLLM (checks in engine_checks.py)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def check_names() -> list[str]:
    """The keys of ``engine_checks.CHECKS``, read from its source: importing it would load LMCache here."""
    tree = ast.parse((HERE / "engine_checks.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CHECKS" for t in node.targets):
            if not isinstance(node.value, ast.Dict):
                break
            return [ast.literal_eval(k) for k in node.value.keys if k is not None]
    raise AssertionError("tests/engine_checks.py has no CHECKS = {name: check, ...} dictionary")


def test_every_check_is_found():
    assert len(check_names()) >= 2


@pytest.mark.parametrize("name", check_names())
def test_engine_check(name):
    # A fresh process per check: see engine_checks.py for why.
    out = subprocess.run([sys.executable, str(HERE / "engine_checks.py"), name],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
