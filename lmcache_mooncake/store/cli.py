"""``lmcache-mooncake store up | status | down``: the embedded Mooncake Store from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmcache_mooncake.store.launcher import ALL_INTERFACES_WARNING
from lmcache_mooncake.store.state import default_state_dir


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``store`` and its actions to the command line's subparsers."""
    p = subparsers.add_parser(
        "store",
        help=help,
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
    up.add_argument("--host", default="127.0.0.1",
                    help="address to bind and announce (default 127.0.0.1: this host only); for instances on "
                    "other hosts, this host's address on their network, e.g. 10.0.0.5 (their master_address "
                    "is then 10.0.0.5:MASTER_PORT)")
    for name in ("master", "metadata", "metrics", "client"):
        up.add_argument(f"--{name}-port", type=int, default=None, help=f"{name} port (default: a free one)")
    for action in (up, sub.add_parser("status", help="health, capacity, object count, addresses"),
                   sub.add_parser("down", help="stop exactly what 'up' started")):
        action.add_argument("--state-dir", default=None,
                            help=f"where the store is recorded (default {default_state_dir()})")
        if action is not up:
            action.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from lmcache_mooncake.config import ConfigError
    from lmcache_mooncake.store.errors import StoreError

    try:
        return {"up": _up, "status": _status, "down": _down}[args.action](args)
    except (StoreError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _up(args: argparse.Namespace) -> int:
    from lmcache_mooncake.config import load_config, parse_size
    from lmcache_mooncake.store.launcher import start_store
    from lmcache_mooncake.store.state import StoreSpec

    mc = None
    if args.config:
        mc = load_config(args.config).mooncake
    state_dir = args.state_dir or (mc.store_dir if mc and mc.store_dir else None) or default_state_dir()
    spec = StoreSpec(
        memory_bytes=parse_size(args.memory),
        host=args.host,
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


def _status(args: argparse.Namespace) -> int:
    from lmcache_mooncake.store.launcher import store_status

    st = store_status(args.state_dir)
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print_status(st)
    return 0 if st.get("healthy") else 1


def _down(args: argparse.Namespace) -> int:
    from lmcache_mooncake.store.launcher import stop_store

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


def print_status(st: dict) -> None:
    """:func:`~lmcache_mooncake.store.launcher.store_status` for people."""
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    print(f"store in {st['state_dir']}: {'healthy' if st.get('healthy') else 'NOT healthy'}")
    if "capacity_bytes" in st:
        print(f"  capacity {gib(st['capacity_bytes'])}, used {gib(st['used_bytes'])}, "
              f"objects {st['object_count']} ({st['soft_pinned_objects']} soft-pinned), clients {st['clients']}, "
              f"evicted {st['evicted_keys']}")
    for k, v in (st.get("addresses") or {}).items():
        print(f"  {k}: {v}")
    for problem in st.get("problems", []):
        print(f"  problem: {problem}")
