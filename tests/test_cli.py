"""The command line: --help explains, check-config prints the config or the errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_mooncake.cli import COMMANDS

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcache_mooncake.cli", *args],
                          capture_output=True, text=True, cwd=REPO)


def test_help_lists_commands_and_the_kv_transfer_config():
    out = cli("--help")
    assert out.returncode == 0
    for word in ("check-config", "make-model", "demo", "store", "serve", "proxy", "up", "warmup",
                 "LMCacheMooncakeConnector"):
        assert word in out.stdout


def test_check_config_prints_resolved_config():
    out = cli("check-config", "configs/both.yaml")
    assert out.returncode == 0, out.stderr
    assert "chunk_size: 256" in out.stdout and "local_disk (resolved)" in out.stdout


def test_check_config_reports_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: 256\nmax_local_cpu_sise: 2\n")
    out = cli("check-config", str(bad))
    assert out.returncode == 2
    assert str(bad) in out.stderr and "max_local_cpu_sise" in out.stderr


def test_unknown_command_is_an_error():
    out = cli("frobnicate")
    assert out.returncode != 0 and "unknown command" in out.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command):
    out = cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: lmcache-mooncake {command} ")


def test_serve_passes_unknown_arguments_to_vllm():
    out = cli("serve", "--role", "both", "--model", "m", "--print-command", "--dtype", "bfloat16",
              "--max-model-len=8192", "-tp", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-5:] == ["--dtype", "bfloat16", "--max-model-len=8192", "-tp", "2"]
    assert '"kv_role": "kv_both"' in out.stdout


def test_serve_gives_vllm_a_shutdown_timeout_unless_told_one():
    """vLLM's default --shutdown-timeout 0 kills the engine at once on SIGTERM, losing chunks
    still being written; serve asks for a graceful shutdown (the connector drains its writes)."""
    out = cli("serve", "--role", "both", "--model", "m", "--print-command")
    assert out.returncode == 0, out.stderr
    assert "--shutdown-timeout 60" in out.stdout
    out = cli("serve", "--role", "both", "--model", "m", "--print-command", "--shutdown-timeout=5")
    assert out.stdout.count("--shutdown-timeout") == 1 and "--shutdown-timeout=5" in out.stdout


def test_other_commands_refuse_unknown_arguments():
    out = cli("check-config", "configs/both.yaml", "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr


def test_serve_refuses_unknown_roles_and_a_second_kv_transfer_config():
    out = cli("serve", "--role", "decoder", "--model", "m", "--print-command")
    assert out.returncode == 2 and "invalid choice: 'decoder'" in out.stderr and "prefill" in out.stderr
    for extra in (["--kv-transfer-config", "{bad"], ["--kv-transfer-config={}"]):
        out = cli("serve", "--role", "both", "--model", "m", "--print-command", *extra)
        assert out.returncode == 2 and "writes vLLM's --kv-transfer-config itself" in out.stderr
        assert out.stdout == ""
    out = cli("serve", "--role", "both", "--model", "m", "--print-command", "--config", "no-such.yaml")
    assert out.returncode == 2 and "no-such.yaml" in out.stderr
