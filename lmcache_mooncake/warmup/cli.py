"""``lmcache-mooncake warmup``: its options and what it prints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmcache_mooncake.warmup.run import warmup, write_progress
from lmcache_mooncake.warmup.summary import BadInputError, InputProblem, WarmupError

EPILOG = """\
input formats:
  .jsonl   one JSON object per line, with exactly one of
             {"prompt": "text"}                      rendered as /v1/completions renders it
             {"prompt_token_ids": [1, 2, 3]}          used as given
             {"messages": [{"role": "system", "content": "..."},
                           {"role": "user", "content": "..."}]}
                                                     rendered as /v1/chat/completions renders it
                                                     (chat template, add_generation_prompt=True)
           and optionally "cache_salt": "tenant-a" (the same salt the requests will carry)
           and "id" (any label). Blank lines are skipped.
  .txt     one document per file, rendered as a /v1/completions text prompt
  FOLDER   every .txt and .jsonl file in it (recursively, in name order)

keys: chunks are found only if the serving instances derive the same keys, so
  warm up with the serving instances' --model string (or set model_id in the
  config, or give --model-id / --server-arg=--served-model-name=NAME), --dtype,
  chunk_size and cache_salt. Tensor parallel size 1 only.

resuming: inputs whose chunks are all in the store are skipped, so running
  the same command again after an interruption writes only what is missing;
  a run with nothing missing starts no vLLM and writes 0 chunks.

bad inputs (malformed JSON, none or several prompt fields, empty prompts,
  prompts longer than the context, unreadable files) are printed as
  "path:line: what; what to do", skipped and counted; with --strict the first
  one stops the command (exit code 2) before anything is written.

exit codes: 0 every good input is in the store (or dry run); 1 some inputs
  could not be written (see the summary and the kept work folder);
  2 bad usage, configuration, model or store, or a bad input with --strict.

example:
  lmcache-mooncake store up --memory 8GiB
  lmcache-mooncake warmup --model /models/llama --config configs/prefill.yaml \\
      --dtype bfloat16 --input examples/warmup_inputs.jsonl --input examples/warmup_docs \\
      --summary-json warmup-summary.json
  lmcache-mooncake warmup ... --dry-run      # what would be written, nothing started
"""



def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``warmup`` to the command line's subparsers."""
    p = subparsers.add_parser(
        "warmup",
        help=help,
        description="Pre-compute the KV cache of known prompts (system prompts, documents, few-shot\n"
        "examples, chat conversations) and store their chunks in the shared Mooncake Store, so that\n"
        "serving instances load them instead of computing them. Inputs are read and tokenized here\n"
        "exactly as vLLM's OpenAI server would; inputs already in the store are skipped; the rest go\n"
        "to one vLLM producer (kv_producer, max_tokens=1) in a child process. Returns when every\n"
        "chunk is verified in the store.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help="model folder or name, exactly as the serving instances pass it to vLLM's --model")
    p.add_argument("--config", required=True,
                   help="cache configuration YAML with a mooncake: section, e.g. configs/prefill.yaml")
    p.add_argument("--input", action="append", required=True, metavar="FILE_OR_DIR",
                   help=".jsonl file, .txt document or folder of them; repeat for several")
    p.add_argument("--dtype", default="auto",
                   help="model dtype, as the serving instances' --dtype (it is the KV dtype, part of the keys; "
                   "default auto)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length; longer prompts are bad inputs (default: the model's)")
    p.add_argument("--model-id", default=None,
                   help="model id in chunk keys (overrides the config's model_id); the serving instances need "
                   "the same model_id")
    p.add_argument("--chat-template", default=None,
                   help="chat template file, if the serving instances are started with --chat-template")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an option of the serving vLLM that changes rendering, e.g. "
                   "--server-arg=--chat-template-content-format=openai; repeatable")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (YAML value), e.g. --set mooncake.store_dir=/tmp/store")
    p.add_argument("--pin", choices=("soft", "hard"), default=None,
                   help="pin the chunks written against eviction: soft (evicted only once no unpinned object is "
                   "left, for --pin-ttl) or hard (never evicted); sets mooncake.pin. Chunks already in the store "
                   "are skipped and keep their pin state")
    p.add_argument("--pin-ttl", type=float, default=None, metavar="SECONDS",
                   help="how long a soft pin lasts (default 1800; the master caps it at 24 h)")
    p.add_argument("--batch-size", type=int, default=16, help="inputs handed to vLLM at a time, scheduled together (default 16)")
    p.add_argument("--kv-cache-gib", type=int, default=2,
                   help="vLLM CPU build: GiB of KV cache for the producer (default 2)")
    p.add_argument("--batch-timeout", type=float, default=900.0,
                   help="seconds a batch may take, the first including vLLM start-up (default 900)")
    p.add_argument("--verify-timeout", type=float, default=60.0,
                   help="seconds to wait for every chunk to show up in the store after the run (default 60)")
    p.add_argument("--strict", action="store_true", help="stop at the first bad input (exit code 2)")
    p.add_argument("--dry-run", action="store_true",
                   help="read and tokenize the inputs, check the store, print what would be written; start nothing")
    p.add_argument("--summary-json", default=None, metavar="PATH", help="also write the summary as JSON here")
    p.add_argument("--work-dir", default=None,
                   help="folder for the vLLM log and counters (default: a temp folder, removed on success)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    return p


def parse_set(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` options as config overrides (YAML values; dotted keys are sections)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise WarmupError(f"--set {item!r}: write KEY=VALUE, e.g. --set chunk_size=256")
        value = yaml.safe_load(raw) if raw.strip() else None
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--set`` items, then ``--pin`` / ``--pin-ttl`` as ``mooncake.pin`` / ``mooncake.pin_ttl``."""
    out = parse_set(args.set)
    if args.pin_ttl is not None and args.pin is None:
        raise WarmupError("--pin-ttl needs --pin soft")
    if args.pin is not None:
        section = out.setdefault("mooncake", {})
        if not isinstance(section, dict):
            raise WarmupError("--pin: --set mooncake=... already replaced the mooncake section")
        section["pin"] = args.pin
        if args.pin_ttl is not None:
            section["pin_ttl"] = args.pin_ttl
    return out


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake warmup``: warm up, print the summary; the exit code says how it went."""
    import logging

    progress = not args.no_progress

    def on_problem(p: InputProblem) -> None:  # printed even with --no-progress
        write_progress(f"warning: {p}")

    try:
        for name in ("vllm", "lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)
        summary = warmup(
            args.model, args.config, args.input,
            overrides=_overrides(args), model_id=args.model_id, dtype=args.dtype,
            max_model_len=args.max_model_len, chat_template=args.chat_template, server_args=args.server_arg,
            batch_size=args.batch_size, strict=args.strict, dry_run=args.dry_run, kv_cache_gib=args.kv_cache_gib,
            batch_timeout_s=args.batch_timeout, verify_timeout_s=args.verify_timeout, work_dir=args.work_dir,
            progress=progress, on_problem=on_problem,
        )
    except BadInputError as e:
        print(f"error: {e.problem}", file=sys.stderr)
        print("stopped at the first bad input (--strict); nothing was written", file=sys.stderr)
        return 2
    except WarmupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary.format())
    if args.summary_json:
        path = Path(args.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary.to_dict(with_inputs=True), indent=2) + "\n")
    return 0 if summary.ok else 1


def main_warmup(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake warmup ARGV``, as the command line runs it."""
    from lmcache_mooncake.cli import main

    return main(["warmup", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main_warmup())
