"""Command-line options of the test suite."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-minutes", type=float, default=1.0,
                     help="minutes of load in tests/test_soak.py (default 1: the short run of make test)")
