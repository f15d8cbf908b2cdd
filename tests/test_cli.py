"""The command line: --help explains, check-config prints the config or the errors."""

import subprocess
import sys
from pathlib import Path

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
