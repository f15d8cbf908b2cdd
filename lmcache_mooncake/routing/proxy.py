"""OpenAI-compatible router for prefill/decode disaggregation.

Every ``/v1/completions`` and ``/v1/chat/completions`` request is read and
checked first (:mod:`lmcache_mooncake.routing.intake`: size limit, body read
timeout, JSON, required fields; a client's own ``kv_transfer_params`` are
removed). Then it goes to a prefill instance as a one-token, non-streaming
request, so that instance computes the prompt's KV cache and stores its chunks
(LMCache tiers / Mooncake Store). The original request then goes to a decode
instance, which finds the prompt's chunks and only generates; its answer (JSON
or an SSE stream, passed through as it arrives) goes back to the client. Only
a ``kv_transfer_params`` object the prefill answered is copied into the decode
request.

With the model's tokenizer (a :class:`~lmcache_mooncake.routing.prompt_keys.PromptKeyer`)
the proxy names the prompt's chunks as the workers do. It then routes by
prefix (:mod:`lmcache_mooncake.routing.placement`: same first chunk, same
instance, within a load bound) and, with a store client
(:class:`~lmcache_mooncake.routing.prompt_keys.StoreCoverage`), sends a request
whose prompt the store (nearly) holds straight to decode, skipping the prefill
round trip (:attr:`ProxyConfig.direct_decode_max_uncached`).

Failures never hang the client: an unreachable instance, a timeout, an upstream
error or a stream that breaks mid-way becomes an OpenAI-style error
(``{"error": {"message", "type", "param", "code"}}``; for a broken stream, a
last ``data: {"error": ...}`` SSE event). A connection error before anything
was sent is retried on the next instance of the same role and takes the
instance out of rotation until its ``/health`` answers again
(:mod:`lmcache_mooncake.routing.pool`: checks with back-off).

Run it with ``lmcache-mooncake proxy --prefill URL... --decode URL... --port P``
(this module: the command's flags and start-up) or serve
:func:`lmcache_mooncake.routing.app.build_app` with any ASGI server. The routing
itself is :mod:`lmcache_mooncake.routing.router`, the SSE relay
:mod:`lmcache_mooncake.routing.relay`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from lmcache_mooncake.routing.app import build_app
from lmcache_mooncake.routing.intake import IntakeLimits
from lmcache_mooncake.routing.prompt_keys import PromptKeyer, StoreCoverage
from lmcache_mooncake.routing.router import ProxyConfig, normalize_url

__all__ = ["add_parser", "main_proxy", "run"]

logger = logging.getLogger("lmcache_mooncake.routing.proxy")


_PROXY_DESCRIPTION = """\
OpenAI-compatible router for prefill/decode disaggregation.

Each /v1/completions or /v1/chat/completions request goes first to a prefill
instance with max_tokens=1 and stream=false, which computes the prompt's KV
cache and stores its chunks; then the original request goes to a decode
instance, which loads those chunks and generates. Streams are passed through as
they arrive. Only the kv_transfer_params the prefill answered go to decode; a
client's own are removed.

Routing (--routing prefix, the default, needs --model): requests whose prompts
share their first chunk go to the same instance of each role (rendezvous
hashing of the chunk key the connector names it by), unless it has
--max-outstanding requests in flight (then: the least loaded instance).
Without --model, or with --routing round-robin: round-robin.

Direct decode (needs --model and --config with a mooncake: section): a request
whose prompt has at most --direct-decode-max-uncached tokens that the store
does not hold skips the prefill round trip.

Instances are health-checked; one that fails is left out (re-checked with
back-off) and taken back when its /health answers again. GET /health is 200
when at least one prefill and one decode instance answer; GET /stats shows the
counters and each instance's state and load. Requests over --max-body-bytes
get 413, a body that takes over --body-timeout seconds 408, invalid JSON or a
missing field 400.
"""

_PROXY_EPILOG = """\
example:
  lmcache-mooncake proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
      http://127.0.0.1:8201 --port 8000 --model /models/qwen --config configs/decode.yaml
  then point any OpenAI client at http://127.0.0.1:8000/v1
"""


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``proxy`` to the command line's subparsers."""
    p = subparsers.add_parser("proxy", help=help, description=_PROXY_DESCRIPTION, epilog=_PROXY_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="prefill vLLM instance(s), e.g. http://127.0.0.1:8100 (repeatable)")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="decode vLLM instance(s), e.g. http://127.0.0.1:8200 (repeatable)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for an instance's answer, or between two chunks of a stream "
                        "(default 600)")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="longest wait to connect to an instance before trying the next one (default 5)")
    p.add_argument("--max-body-bytes", type=int, default=IntakeLimits.max_body_bytes, metavar="BYTES",
                   help=f"largest request body accepted, else 413 (default {IntakeLimits.max_body_bytes})")
    p.add_argument("--body-timeout", type=float, default=IntakeLimits.read_timeout_s, metavar="SECONDS",
                   help=f"longest time a request body may take to arrive, else 408 "
                        f"(default {IntakeLimits.read_timeout_s:g})")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                   help="prefix: same first chunk, same instance (needs --model); round-robin (default prefix)")
    p.add_argument("--max-outstanding", type=int, default=ProxyConfig.max_outstanding, metavar="N",
                   help="requests in flight on the preferred instance past which a request goes to the "
                        f"least loaded one (default {ProxyConfig.max_outstanding})")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="the model the instances serve (its tokenizer names the chunks: prefix routing, "
                        "direct decode)")
    p.add_argument("--dtype", default="auto", help="the instances' vLLM --dtype (it enters chunk names)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the instances' cache configuration (chunk size, model id, store)")
    p.add_argument("--store-dir", default=None, metavar="DIR",
                   help="state folder of the store from 'lmcache-mooncake store up' (overrides the config's)")
    p.add_argument("--direct-decode-max-uncached", type=int, default=256, metavar="TOKENS",
                   help="skip prefill when at most this many prompt tokens are not in the store "
                        "(default 256; needs --model)")
    p.add_argument("--no-direct-decode", action="store_true", help="always go through a prefill instance")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake proxy``: check the flags and serve the proxy with uvicorn."""
    from lmcache_mooncake.obs.logs import setup_logging

    p = args.parser
    if not 0 < args.port < 65536:
        p.error(f"--port {args.port} is not a valid port")
    direct = None if args.no_direct_decode else args.direct_decode_max_uncached
    try:
        config = ProxyConfig(timeout_s=args.timeout, connect_timeout_s=args.connect_timeout,
                             limits=IntakeLimits(args.max_body_bytes, args.body_timeout),
                             routing=args.routing, max_outstanding=args.max_outstanding,
                             direct_decode_max_uncached=direct)
        for u in (*args.prefill, *args.decode):
            normalize_url(u)
    except ValueError as e:
        p.error(str(e))
    setup_logging()
    logging.getLogger("lmcache_mooncake").setLevel(args.log_level.upper())
    keyer = coverage = None
    if args.model is not None:
        keyer, coverage = _prompt_parts(args, direct is not None)
    try:
        app = build_app(args.prefill, args.decode, config, keyer=keyer, coverage=coverage)
    except ValueError as e:
        p.error(str(e))

    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


def _prompt_parts(args: argparse.Namespace, direct: bool) -> tuple[PromptKeyer, StoreCoverage | None]:
    """The tokenizer and chunk naming of ``--model``, and a store client when direct decode may use it."""
    from lmcache_mooncake.routing.prompt_keys import PromptKeySpec

    try:
        keyer = PromptKeyer(PromptKeySpec(args.model, args.dtype, args.config, args.store_dir))
    except Exception as e:  # noqa: BLE001 - any failure here is "cannot name this model's chunks"
        args.parser.error(f"--model {args.model}: cannot load its tokenizer and chunk naming: {e}")
    logger.info("chunk names: namespace %s (model %s, %s, chunk size %d)", keyer.namespace.hex()[:16],
                keyer.namespace.model, keyer.namespace.kv_dtype, keyer.namespace.chunk_size)
    coverage = None
    if direct and keyer.config.mooncake is not None:
        try:
            coverage = StoreCoverage.connect(keyer.config, keyer.namespace)
        except Exception as e:  # noqa: BLE001 - without the store, only short prompts go direct
            logger.warning("direct decode cannot ask the store (%s): only prompts of at most "
                           "--direct-decode-max-uncached tokens go straight to decode", e)
    return keyer, coverage


def main_proxy(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake proxy ARGV``."""
    import sys

    from lmcache_mooncake.cli import main

    return main(["proxy", *(sys.argv[1:] if argv is None else argv)])
