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


def _make_model(argv: list[str]) -> int:
    from lmcache_mooncake.models import main_make_model

    return main_make_model(argv)


def _demo(argv: list[str]) -> int:
    from lmcache_mooncake.demo import main_demo

    return main_demo(argv)


COMMANDS = {
    "check-config": (_check_config, "validate a configuration file and print it resolved"),
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
