"""The ``lmcache-mooncake`` command line: wires the commands, each defined in its own module.

Every command module has ``add_parser(subparsers, help)``, which adds the
command's parser (its options, description and epilog) and sets
``run=run``, and ``run(args) -> int``. Only the module of the command given
is imported, so ``lmcache-mooncake store status`` does not load the proxy or
vLLM. A command that passes unknown arguments on (``serve``, to vLLM) sets
``pass_through=True`` and finds them in ``args.passed_through``.
"""

from __future__ import annotations

import argparse
import importlib
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

#: command -> (module with add_parser and run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "store": ("lmcache_mooncake.store.cli",
              "start, inspect or stop the embedded Mooncake Store (up | status | down)"),
    "check-config": ("lmcache_mooncake.commands.check_config", "validate a configuration file and print it resolved"),
    "explain": ("lmcache_mooncake.commands.explain", "why a prompt misses: its key namespace, chunk keys and the tiers holding them"),
    "up": ("lmcache_mooncake.commands.up",
           "the whole local stack: store, prefill and decode vLLM, proxy (--demo: show it working)"),
    "proxy": ("lmcache_mooncake.routing.proxy",
              "OpenAI-compatible router: prompt to a prefill instance, then to a decode instance"),
    "warmup": ("lmcache_mooncake.warmup.cli",
               "compute known prompts once and store their KV chunks in the shared store (resumable)"),
    "serve": ("lmcache_mooncake.commands.serve",
              "start vLLM's OpenAI server as a prefill, decode or both instance with the connector"),
    "make-model": ("lmcache_mooncake.testing.models", "build a deterministic test model folder (no hub needed)"),
    "stats": ("lmcache_mooncake.commands.stats", "read running instances' /metrics and the store: hits, bytes, failures"),
    "demo": ("lmcache_mooncake.commands.demo", "run one vLLM instance twice on a generated model and show the cache hits"),
}


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser, with the full parser of ``command`` (returned too) and a one-line
    entry for every other command."""
    parser = argparse.ArgumentParser(
        prog="lmcache-mooncake",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'lmcache-mooncake COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"lmcache-mooncake {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            chosen = importlib.import_module(module).add_parser(sub, help_text)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser, chosen


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        build_parser()[0].parse_args(argv or ["--help"])
        return 0
    if argv[0] not in COMMANDS:
        build_parser()[0].error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    parser, command = build_parser(argv[0])
    if command is None:
        raise RuntimeError(f"{COMMANDS[argv[0]][0]}.add_parser returned no parser")
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "pass_through", False):
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passed_through = rest
    args.parser = command
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
