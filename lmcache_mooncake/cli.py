"""The ``lmcache-mooncake`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from lmcache_mooncake import __version__

_DESCRIPTION = """\
Share vLLM KV cache between instances: content-hashed chunks through LMCache's
CPU and disk tiers (and a Mooncake Store).

Use it in vLLM with:
  --kv-transfer-config '{"kv_connector":"LMCacheMooncakeConnector",
    "kv_connector_module_path":"lmcache_mooncake.connector","kv_role":"kv_both",
    "kv_connector_extra_config":{"config_file":"configs/both.yaml"}}'
"""


def _check_config(argv: list[str]) -> int:
    from lmcache_mooncake.config import ConfigError, load_config

    p = argparse.ArgumentParser(
        prog="lmcache-mooncake check-config",
        description="Load a cache configuration file, validate every key, and print the "
        "resolved configuration (after LMCACHE_MOONCAKE_<KEY> environment overrides).",
    )
    p.add_argument("file", help="YAML configuration file, e.g. configs/both.yaml")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML-like lines")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = cfg.to_dict()
    data["local_disk (resolved)"] = str(cfg.disk_path) if cfg.disk_path else None
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"# {args.file}: OK")
        for k, v in data.items():
            print(f"{k}: {json.dumps(v)}")
    return 0


def _store(argv: list[str]) -> int:
    from lmcache_mooncake.config import ConfigError, load_config, parse_size
    from lmcache_mooncake.store.launcher import (
        ALL_INTERFACES_WARNING,
        StoreError,
        StoreSpec,
        default_state_dir,
        start_store,
        stop_store,
        store_status,
    )

    p = argparse.ArgumentParser(
        prog="lmcache-mooncake store",
        description="Run the embedded Mooncake Store on this host: a master (with its HTTP metadata "
        "server) and one storage process that owns the store memory. vLLM processes attach as clients "
        "that own no store memory, so a vLLM process that dies loses no cached chunk. Configs with "
        "mooncake.master_address: auto find the store recorded here.",
        epilog=f"Warning: {ALL_INTERFACES_WARNING}",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the store, wait until it answers, record what was started")
    up.add_argument("--memory", default="4GiB", help="store memory owned by the storage process (default 4GiB)")
    up.add_argument("--config", help="cache YAML whose mooncake: section gives protocol, rdma_devices, store_dir")
    for name in ("master", "metadata", "metrics", "client"):
        up.add_argument(f"--{name}-port", type=int, default=None, help=f"{name} port (default: a free one)")
    for action in (up, sub.add_parser("status", help="health, capacity, object count, addresses"),
                   sub.add_parser("down", help="stop exactly what 'up' started")):
        action.add_argument("--state-dir", default=None,
                            help=f"where the store is recorded (default {default_state_dir()})")
        if action is not up:
            action.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)

    try:
        if args.action == "up":
            mc = None
            if args.config:
                mc = load_config(args.config).mooncake
            state_dir = args.state_dir or (mc.store_dir if mc and mc.store_dir else None) or default_state_dir()
            spec = StoreSpec(
                memory_bytes=parse_size(args.memory),
                master_port=args.master_port,
                metadata_port=args.metadata_port,
                metrics_port=args.metrics_port,
                client_port=args.client_port,
                state_dir=state_dir,
                protocol=mc.protocol if mc else "tcp",
                rdma_devices=mc.rdma_devices if mc else "",
            )
            st = start_store(spec)
            print(f"Mooncake store up ({args.memory}), recorded in {st.state_dir}")
            for k, v in st.addresses().items():
                print(f"  {k}: {v}")
            return 0
        if args.action == "status":
            st = store_status(args.state_dir)
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                _print_status(st)
            return 0 if st.get("healthy") else 1
        res = stop_store(args.state_dir)
        if args.json:
            print(json.dumps(res, indent=2))
        elif not res["was_recorded"]:
            print("no store recorded; nothing to stop")
        else:
            print(f"stopped: {', '.join(res['stopped']) or 'nothing'}"
                  + (f"; already gone: {', '.join(res['already_gone'])}" if res["already_gone"] else "")
                  + (f"; left alone: {', '.join(res['skipped'])}" if res["skipped"] else ""))
        return 0
    except (StoreError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _print_status(st: dict) -> None:
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    print(f"store in {st['state_dir']}: {'healthy' if st.get('healthy') else 'NOT healthy'}")
    if "capacity_bytes" in st:
        print(f"  capacity {gib(st['capacity_bytes'])}, used {gib(st['used_bytes'])}, "
              f"objects {st['object_count']}, clients {st['clients']}, evicted {st['evicted_keys']}")
    for k, v in (st.get("addresses") or {}).items():
        print(f"  {k}: {v}")
    for problem in st.get("problems", []):
        print(f"  problem: {problem}")


def _make_model(argv: list[str]) -> int:
    from lmcache_mooncake.testing.models import main_make_model

    return main_make_model(argv)


def _serve(argv: list[str]) -> int:
    from lmcache_mooncake.serve import main_serve

    return main_serve(argv)


def _up(argv: list[str]) -> int:
    from lmcache_mooncake.stack import main_up

    return main_up(argv)


def _proxy(argv: list[str]) -> int:
    from lmcache_mooncake.proxy import main_proxy

    return main_proxy(argv)


def _warmup(argv: list[str]) -> int:
    from lmcache_mooncake.warmup import main_warmup

    return main_warmup(argv)


def _demo(argv: list[str]) -> int:
    from lmcache_mooncake.demo import main_demo

    return main_demo(argv)


COMMANDS = {
    "store": (_store, "start, inspect or stop the embedded Mooncake Store (up | status | down)"),
    "check-config": (_check_config, "validate a configuration file and print it resolved"),
    "up": (_up, "the whole local stack: store, prefill and decode vLLM, proxy (--demo: show it working)"),
    "proxy": (_proxy, "OpenAI-compatible router: prompt to a prefill instance, then to a decode instance"),
    "warmup": (_warmup, "compute known prompts once and store their KV chunks in the shared store (resumable)"),
    "serve": (_serve, "start vLLM's OpenAI server as a prefill, decode or both instance with the connector"),
    "make-model": (_make_model, "build a deterministic test model folder (no hub needed)"),
    "demo": (_demo, "run one vLLM instance twice on a generated model and show the cache hits"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="lmcache-mooncake",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'lmcache-mooncake COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-mooncake {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
