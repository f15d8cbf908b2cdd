"""``lmcache-mooncake explain``: for one prompt, its key namespace, its chunk keys, which tier
holds each chunk, and, when chunks are missing, under which other namespace the same tokens
are stored and which field differs.

Nothing here derives names on its own: the namespace is
:func:`lmcache_mooncake.warmup.planning.key_namespace` (the function warm-up uses, which
calls :func:`lmcache_mooncake.chunks.keys.namespace_for` as the connector's worker does), the
model's dtype, layers and heads come from vLLM's own model configuration
(:class:`~lmcache_mooncake.warmup.rendering.PromptRenderer`, which resolves ``--dtype auto``
as the server does), prompts are tokenized as vLLM's OpenAI server tokenizes them
(:func:`~lmcache_mooncake.warmup.inputs.read_inputs`), and chunk, file and object names
are :mod:`lmcache_mooncake.chunks.keys`'. Other namespaces are found through the manifests writers
record beside their chunks (:mod:`lmcache_mooncake.chunks.namespaces`).

The report itself (:func:`explain`) works on two small views, one per listable tier
(:class:`DiskView`, :class:`StoreView`), so it is tested without a store or vLLM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lmcache_mooncake.chunks import keys, namespaces
from lmcache_mooncake.chunks.keys import KeyNamespace

CPU_NOTE = ("the CPU tier lives in the memory of a running vLLM process and cannot be listed from here; "
            "its counters are on its /metrics (lmcache-mooncake stats --url URL)")
#: Default port of mooncake_master's admin HTTP server (its --metrics_port), which lists keys.
MASTER_HTTP_PORT = 9003
#: Largest manifest read back from the store.
MANIFEST_MAX_BYTES = 64 << 10
#: Values tried for a field when no manifest explains a miss (chunks written before manifests
#: existed, or a manifest evicted from the store): the usual causes of a mismatch.
GUESSES = {"kv_dtype": ("bfloat16", "float16", "float32"), "chunk_size": (256, 128, 512)}


class TierView(Protocol):
    """What :func:`explain` asks of a tier it can list."""

    name: str
    where: str

    def holds(self, namespace: KeyNamespace, chunk_keys: list[keys.ChunkKey]) -> list[bool]:
        """For each chunk key, whether this tier holds it under ``namespace``."""

    def manifests(self) -> tuple[list[KeyNamespace], list[str]]:
        """The namespaces recorded in this tier, and problems met listing them."""


class DiskView:
    """The disk tier's folder (``local_disk``): a chunk is there if its file is."""

    name = "disk"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.where = str(self.root)

    def holds(self, namespace: KeyNamespace, chunk_keys: list[keys.ChunkKey]) -> list[bool]:
        return [(self.root / keys.file_name(namespace, k)).is_file() for k in chunk_keys]

    def manifests(self) -> tuple[list[KeyNamespace], list[str]]:
        return namespaces.list_disk_manifests(self.root)


class StoreView:
    """The Mooncake store: existence checks through a store client, manifests through the
    master's admin HTTP server (``/get_all_keys``), which is the only way to list objects."""

    name = "store"

    def __init__(self, client: Any, master_http: str | None, where: str):
        self.client = client
        self.master_http = master_http.rstrip("/") if master_http else None
        self.where = where

    def holds(self, namespace: KeyNamespace, chunk_keys: list[keys.ChunkKey]) -> list[bool]:
        return self.client.batch_exists([keys.object_name(namespace, k) for k in chunk_keys])

    def manifests(self) -> tuple[list[KeyNamespace], list[str]]:
        if self.master_http is None:
            return [], ["the store's objects cannot be listed: give the master's admin URL with --master-http"]
        url = f"{self.master_http}/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                listing = r.read().decode("utf-8", "replace").split()
        except (OSError, urllib.error.URLError) as e:
            return [], [f"cannot list the store's objects at {url} ({e}); give the master's admin URL "
                        f"(mooncake_master --metrics_port, default {MASTER_HTTP_PORT}) with --master-http"]
        names = namespaces.store_manifest_names(listing)
        found: list[KeyNamespace] = []
        problems: list[str] = []
        buffers = [bytearray(MANIFEST_MAX_BYTES) for _ in names]
        codes = self.client.batch_get_into(names, buffers) if names else []
        for name, buf, code in zip(names, buffers, codes, strict=True):
            if code < 0:
                problems.append(f"store object {name}: cannot be read (code {code})")
                continue
            try:
                found.append(namespaces.parse_manifest(bytes(buf[:code]), f"store object {name}",
                                                       expected_hex=name.split("/")[1]))
            except namespaces.ManifestError as e:
                problems.append(str(e))
        return found, problems


# -- the report -----------------------------------------------------------------


@dataclass
class ChunkReport:
    index: int
    start: int
    end: int
    key: str
    #: tier name -> holds this chunk (only tiers that could be asked)
    held: dict[str, bool] = field(default_factory=dict)


@dataclass
class ElsewhereReport:
    """The prompt's chunks stored under another namespace."""

    tier: str
    namespace: str
    fields: dict[str, Any]
    chunks_held: int
    differences: list[dict[str, Any]]
    #: "manifest": a namespace recorded in the tier; "guess": one of :data:`GUESSES`, tried
    #: because no manifest explained the miss.
    source: str = "manifest"

    @property
    def summary(self) -> str:
        return "; ".join(d["description"] for d in self.differences)


@dataclass
class Explanation:
    """What ``explain`` found for one prompt; :meth:`format` prints it, :meth:`to_dict` is ``--json``."""

    namespace: dict[str, Any]
    namespace_digest: str
    prompt_tokens: int
    cache_salt: str | None
    chunks: list[ChunkReport]
    tiers: dict[str, str]
    notes: list[str] = field(default_factory=list)
    elsewhere: list[ElsewhereReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def held_chunks(self) -> int:
        """Length of the prefix of chunks some listed tier holds (what a lookup would find)."""
        n = 0
        for c in self.chunks:
            if not any(c.held.values()):
                break
            n += 1
        return n

    @property
    def verdict(self) -> str:
        total, held = len(self.chunks), self.held_chunks
        if not self.tiers:
            return "no tier to list: the configuration has no disk tier and no reachable store"
        if total and held == total:
            return f"held: all {total} chunks are stored ({', '.join(self._holders())})"
        head = (f"missing: {held} of {total} chunks are stored as a prefix; a request loads "
                f"{self.chunks[held - 1].end if held else 0} of {self.prompt_tokens} tokens")
        if self.elsewhere:
            best = self.elsewhere[0]
            how = "" if best.source == "manifest" else " (found by trying other values; no manifest records it)"
            return (f"{head}. The same tokens are stored in the {best.tier} under namespace "
                    f"{best.namespace[:16]}...{how}: {best.summary}")
        return (f"{head}. No other namespace recorded here holds its first chunk: it was never written, "
                "was evicted, or was written from other tokens (chat template, cache_salt, tokenizer)")

    def _holders(self) -> list[str]:
        return [t for t in self.tiers if all(c.held.get(t) for c in self.chunks)] or ["spread over tiers"]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["held_chunks"] = self.held_chunks
        out["verdict"] = self.verdict
        for e, d in zip(self.elsewhere, out["elsewhere"], strict=True):
            d["summary"] = e.summary
        return out

    def format(self) -> str:
        ns = self.namespace
        lines = [
            "key namespace",
            f"  model id    {ns['model']}",
            f"  kv dtype    {ns['kv_dtype']}",
            f"  layers      {ns['num_layers']}",
            f"  kv heads    {ns['num_kv_heads']}",
            f"  head size   {ns['head_size']}",
            f"  chunk size  {ns['chunk_size']}",
            f"  chunks as   {ns.get('chunk_layout', keys.TOKENS)}",
            f"  tensor par. {ns['tp_size']} (rank {ns['tp_rank']})",
            f"  digest      {self.namespace_digest}",
            f"prompt: {self.prompt_tokens} tokens, cache_salt {self.cache_salt!r}, {len(self.chunks)} chunks",
            "tiers:",
        ]
        lines += [f"  {name:<6} {where}" for name, where in self.tiers.items()]
        lines += [f"  note: {n}" for n in self.notes]
        names = list(self.tiers)
        lines.append("chunk  tokens        " + " ".join(f"{n:<6}" for n in names) + " key")
        for c in self.chunks:
            marks = " ".join(f"{'yes' if c.held.get(n) else 'no':<6}" for n in names)
            lines.append(f"{c.index:>5}  {c.start:>5}-{c.end:<6} {marks} {c.key}")
        for e in self.elsewhere:
            lines.append(f"elsewhere: {e.tier} holds {e.chunks_held} of these chunks under namespace {e.namespace}: "
                         f"{e.summary}")
        lines += [f"problem: {p}" for p in self.problems]
        lines.append(self.verdict)
        return "\n".join(lines)


def explain(namespace: KeyNamespace, tokens: list[int], cache_salt: str | None, views: list[TierView], *,
            include_partial: bool = True, notes: list[str] | None = None,
            problems: list[str] | None = None) -> Explanation:
    """The report for ``tokens`` under ``namespace``, asking each tier in ``views``.

    For chunks missing from every tier, each namespace recorded in a tier's
    manifests is tried: the prompt's chunk keys are recomputed under it, and
    if that tier holds the first one the namespace is reported with the
    fields that differ, most chunks first. If no manifest explains the miss,
    the usual suspects (:data:`GUESSES`: other KV dtypes and chunk sizes) are
    tried the same way and reported with ``source="guess"``.
    """
    ck = keys.chunk_keys(namespace, tokens, cache_salt, include_partial=include_partial)
    report = Explanation(
        namespace=asdict(namespace), namespace_digest=namespace.hex(), prompt_tokens=len(tokens),
        cache_salt=cache_salt, chunks=[ChunkReport(i, k.start, k.end, k.hex) for i, k in enumerate(ck)],
        tiers={v.name: v.where for v in views}, notes=list(notes or []), problems=list(problems or []),
    )
    for view in views:
        for c, held in zip(report.chunks, view.holds(namespace, ck), strict=True):
            c.held[view.name] = bool(held)
    if report.held_chunks == len(report.chunks):
        return report
    recorded: dict[str, list[KeyNamespace]] = {}
    for view in views:
        stored, listing_problems = view.manifests()
        report.problems += listing_problems
        recorded[view.name] = stored
        for other in dict.fromkeys(stored):
            if other != namespace:
                _try_namespace(report, view, other, namespace, tokens, cache_salt, include_partial, "manifest")
    if not report.elsewhere:
        for view in views:
            for other in _guesses(namespace):
                if other != namespace and other not in recorded[view.name]:
                    _try_namespace(report, view, other, namespace, tokens, cache_salt, include_partial, "guess")
    report.elsewhere.sort(key=lambda e: (-e.chunks_held, len(e.differences)))
    return report


def _guesses(namespace: KeyNamespace) -> list[KeyNamespace]:
    """``namespace`` with each combination of :data:`GUESSES` values."""
    out = []
    for dtype in GUESSES["kv_dtype"]:
        for size in GUESSES["chunk_size"]:
            out.append(dataclasses.replace(namespace, kv_dtype=dtype, chunk_size=size))
    return out


def _try_namespace(report: Explanation, view: TierView, other: KeyNamespace, namespace: KeyNamespace,
                   tokens: list[int], cache_salt: str | None, include_partial: bool, source: str) -> None:
    """Add ``other`` to ``report.elsewhere`` if ``view`` holds the prompt's first chunk under it."""
    other_keys = keys.chunk_keys(other, tokens, cache_salt, include_partial=include_partial)
    held = view.holds(other, other_keys[:1])
    if not held or not held[0]:
        return
    report.elsewhere.append(ElsewhereReport(
        tier=view.name, namespace=other.hex(), fields=asdict(other),
        chunks_held=sum(bool(h) for h in view.holds(other, other_keys)),
        differences=[{**asdict(d), "description": d.describe()} for d in namespaces.differences(other, namespace)],
        source=source,
    ))


# -- the command ------------------------------------------------------------------

EPILOG = """\
what it needs: the serving instances' --model string (or model_id), the same cache
configuration, and the serving options that enter the keys: --dtype (default auto, as
vLLM's; on the CPU build auto serves a float32 model as bfloat16) and
--tensor-parallel-size. Rendering options (--chat-template, --server-arg) matter for
--prompt and --messages, as they do in warm-up.

what it shows: the key namespace (model id, kv dtype, layers, kv heads, head size, chunk
size, tensor parallel size and rank, digest); for each chunk its key and whether the disk
tier (local_disk) and the Mooncake store (mooncake:, if reachable) hold it. The CPU tier
is inside a running vLLM and cannot be listed. When chunks are missing it reads the
namespace manifests writers record (<local_disk>/<ns>/namespace.json, store object
lmcm/<ns>/namespace), recomputes the prompt's keys under each and names the namespaces
that hold them and the fields that differ, e.g.
  stored with kv dtype bfloat16, this instance uses float32

exit codes: 0 every chunk is stored; 1 some chunk is missing; 2 bad usage, configuration,
model or input.

examples:
  lmcache-mooncake explain --model /models/llama --config configs/decode.yaml \\
      --dtype float32 --prompt "The text of a prompt"
  lmcache-mooncake explain --model /models/llama --config configs/decode.yaml \\
      --jsonl examples/warmup_inputs.jsonl --line 2 --json
"""


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``explain`` to the command line's subparsers."""
    p = subparsers.add_parser(
        "explain", help=help, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Why does a prompt miss the cache? Print the key namespace an instance with these\n"
        "options derives, each chunk's key and the tiers that hold it, and for missing chunks the\n"
        "stored namespaces that hold the same tokens and the fields that differ.",
    )
    p.add_argument("--model", required=True, help="model folder or name, exactly as the instance's vLLM --model")
    p.add_argument("--config", required=True, help="the instance's cache configuration YAML")
    p.add_argument("--dtype", default="auto", help="the instance's vLLM --dtype (the KV dtype; default auto)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="the instance's vLLM "
                   "--tensor-parallel-size (default 1)")
    p.add_argument("--tp-rank", type=int, default=0,
                   help="the worker whose chunks to show (default 0, the one that answers lookups)")
    p.add_argument("--model-id", default=None, help="model id in chunk keys (overrides the config's model_id)")
    p.add_argument("--max-model-len", type=int, default=None, help="the instance's --max-model-len")
    p.add_argument("--chat-template", default=None, help="the instance's --chat-template file, if any")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="another option of the instance that changes rendering or the served model name, "
                   "e.g. --server-arg=--served-model-name=llama; repeatable")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (YAML value), e.g. --set mooncake.store_dir=/tmp/store")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="a text prompt, tokenized as /v1/completions does")
    prompt.add_argument("--token-ids", help="token ids, comma-separated or a JSON list")
    prompt.add_argument("--messages", help="chat messages as JSON, rendered as /v1/chat/completions does")
    prompt.add_argument("--jsonl", metavar="FILE", help="a warm-up input file; with --line")
    p.add_argument("--line", type=int, default=None, help="line number (from 1) in --jsonl")
    p.add_argument("--cache-salt", default=None, help="the request's cache_salt (a --jsonl line's own wins)")
    p.add_argument("--master-http", default=None, metavar="URL",
                   help="admin HTTP server of mooncake_master (its --metrics_port), to list the store's "
                   "namespace manifests; default: the embedded store's, or port "
                   f"{MASTER_HTTP_PORT} of the master's host")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)
    return p


class ExplainError(Exception):
    """Bad usage, configuration, model or input; the message says what to do."""


def _prompt_item(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The prompt as a warm-up input line, and where it came from (for messages)."""
    salt = {"cache_salt": args.cache_salt} if args.cache_salt else {}
    if args.jsonl is None and args.line is not None:
        raise ExplainError("--line goes with --jsonl FILE")
    if args.prompt is not None:
        return {"prompt": args.prompt, **salt}, "--prompt"
    if args.token_ids is not None:
        raw = args.token_ids.strip()
        try:
            ids = json.loads(raw) if raw.startswith("[") else [int(t) for t in raw.replace(",", " ").split()]
        except ValueError:
            raise ExplainError(f"--token-ids {raw[:40]!r}: give integers, e.g. --token-ids 1,2,3 or '[1, 2, 3]'") \
                from None
        return {"prompt_token_ids": ids, **salt}, "--token-ids"
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except ValueError as e:
            raise ExplainError(f"--messages is not JSON ({e}); give e.g. "
                               "'[{\"role\": \"user\", \"content\": \"hi\"}]'") from None
        return {"messages": messages, **salt}, "--messages"
    if args.line is None or args.line < 1:
        raise ExplainError("--jsonl needs --line N (the line number, from 1)")
    path = Path(args.jsonl)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ExplainError(f"{path}: cannot read it ({e})") from None
    if args.line > len(lines):
        raise ExplainError(f"{path}: has {len(lines)} lines, there is no line {args.line}")
    try:
        obj = json.loads(lines[args.line - 1])
    except ValueError as e:
        raise ExplainError(f"{path}:{args.line}: malformed JSON ({e})") from None
    if isinstance(obj, dict) and args.cache_salt and "cache_salt" not in obj:
        obj["cache_salt"] = args.cache_salt
    return obj, f"{path}:{args.line}"


def _store_view(cfg: Any, master_http: str | None, log: Path, problems: list[str]) -> tuple[StoreView | None, Any]:
    from lmcache_mooncake.warmup.planning import connect
    from lmcache_mooncake.warmup.summary import WarmupError

    mc = cfg.mooncake
    try:
        client = connect(cfg, log)
    except WarmupError as e:
        problems.append(f"the Mooncake store cannot be asked: {e}")
        return None, None
    if master_http is None:
        if mc.master_address == "auto":
            from lmcache_mooncake.store.state import read_state

            state = read_state(mc.store_dir)
            master_http = state.metrics_url if state is not None else None
        else:
            master_http = f"http://{mc.master_address.rpartition(':')[0]}:{MASTER_HTTP_PORT}"
    where = f"Mooncake store, master {client.master_addr or client.client_addr} ({client.mode} mode)"
    if not client.healthy:
        problems.append(f"the Mooncake store does not answer ({client.stats()['last_error']}); "
                        "check it with 'lmcache-mooncake store status'")
    return StoreView(client, master_http, where), client


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake explain``: print the report; 0 all chunks stored, 1 some missing, 2 errors."""
    import logging
    import tempfile

    for name in ("vllm", "lmcache"):
        logging.getLogger(name).setLevel(logging.WARNING)
    client = None
    try:
        try:
            report, client = _explain_args(args, Path(tempfile.gettempdir()) / "lmcm-explain-store.log")
        finally:
            if client is not None:
                from lmcache_mooncake.warmup.planning import quiet_stderr

                with quiet_stderr(Path(tempfile.gettempdir()) / "lmcm-explain-store.log"):
                    client.close()
    except ExplainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.chunks and report.held_chunks == len(report.chunks) else 1


def _explain_args(args: argparse.Namespace, store_log: Path) -> tuple[Explanation, Any]:
    from lmcache_mooncake.config import ConfigError, load_config
    from lmcache_mooncake.warmup.cli import parse_set
    from lmcache_mooncake.warmup.inputs import read_inputs
    from lmcache_mooncake.warmup.planning import key_namespace
    from lmcache_mooncake.warmup.rendering import get_renderer
    from lmcache_mooncake.warmup.summary import BadInputError, WarmupError

    if args.tensor_parallel_size < 1 or not 0 <= args.tp_rank < args.tensor_parallel_size:
        raise ExplainError(f"--tp-rank {args.tp_rank} is not in [0, --tensor-parallel-size "
                           f"{args.tensor_parallel_size})")
    item, source = _prompt_item(args)
    try:
        overrides = parse_set(args.set)
        if args.model_id:
            overrides["model_id"] = args.model_id
        cfg = load_config(args.config, overrides=overrides)
        renderer = get_renderer(args.model, args.dtype, args.max_model_len, args.chat_template, args.server_arg)
        good, _ = read_inputs([item], renderer, strict=True)
    except BadInputError as e:
        raise ExplainError(f"{source}: {e.problem.message}") from None
    except (ConfigError, WarmupError) as e:
        raise ExplainError(str(e)) from None
    (prompt,) = good
    ns = key_namespace(renderer.info, cfg, tp_size=args.tensor_parallel_size, tp_rank=args.tp_rank)
    notes, problems = [CPU_NOTE], []
    views: list[TierView] = []
    if cfg.disk_path is not None:
        views.append(DiskView(cfg.disk_path))
    else:
        notes.append("no disk tier: local_disk is null in this configuration")
    client = None
    if cfg.mooncake is not None:
        view, client = _store_view(cfg, args.master_http, store_log, problems)
        if view is not None:
            views.append(view)
    else:
        notes.append("no store: the configuration has no mooncake: section")
    report = explain(ns, prompt.token_ids, prompt.cache_salt, views, include_partial=cfg.save_unfull_chunk,
                     notes=notes, problems=problems)
    return report, client
