"""``lmcache-mooncake check-config``: load a configuration file, validate it, print it resolved."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``check-config`` to the command line's subparsers."""
    p = subparsers.add_parser(
        "check-config",
        help=help,
        description="Load a cache configuration file, validate every key, and print the "
        "resolved configuration (after LMCACHE_MOONCAKE_<KEY> environment overrides).",
    )
    p.add_argument("file", help="YAML configuration file, e.g. configs/both.yaml")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML-like lines")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from lmcache_mooncake.config import ConfigError, load_config

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
