"""``lmcache-mooncake up`` without starting anything: core placement, the proxy's dtype, refused counts."""

from __future__ import annotations

import pytest

from lmcache_mooncake.cli import main
from lmcache_mooncake.commands.up import _vllm_dtype, core_sets


def test_core_sets_are_disjoint_when_there_are_enough_cores():
    assert core_sets(1, [0, 1]) == [[0, 1]]
    assert core_sets(2, [0, 1]) == [[0], [1]]
    assert core_sets(3, list(range(8))) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # More instances than cores: one core each, in turn.
    assert core_sets(3, [0, 1]) == [[0], [1], [0]]
    with pytest.raises(ValueError):
        core_sets(0, [0])


def test_proxy_gets_the_instances_dtype():
    assert _vllm_dtype(["--dtype=float32", "--enforce-eager"]) == "float32"
    assert _vllm_dtype(["--max-model-len", "4096", "--dtype", "bfloat16"]) == "bfloat16"
    assert _vllm_dtype([]) == "auto"


@pytest.mark.parametrize(("flags", "says"), [
    (["--prefill", "0"], "at least one instance"),
    (["--decode", "400"], "start fewer"),
])
def test_up_refuses_impossible_instance_counts(flags, says, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["up", "--model", "/nonexistent", *flags])
    assert ei.value.code == 2
    assert says in capsys.readouterr().err
