"""``lmcache-mooncake warmup``: compute prompts once and leave their KV chunks in the shared store.

Before real traffic arrives (a system prompt every chat starts with, documents
users will ask about, few-shot examples), run them through one vLLM producer
so that every decode instance finds their chunks in the Mooncake Store:

    lmcache-mooncake warmup --model MODEL --config configs/prefill.yaml --input prompts.jsonl

What it does, in order:

1. **Reads and renders the inputs in this process**, with vLLM's own request
   rendering (:class:`PromptRenderer`: the ``OnlineRenderer`` of vLLM's OpenAI
   server, built without an engine, as vLLM's CPU-only render server builds
   it). A ``messages`` line becomes exactly the token ids
   ``/v1/chat/completions`` gives the same messages (the model's chat
   template, ``add_generation_prompt=True``); a ``prompt`` line and a ``.txt``
   document become what ``/v1/completions`` gives that text (special tokens
   added as the tokenizer does by default); ``prompt_token_ids`` are used as
   given. Bad inputs are reported as ``path:line: what; what to do``.
2. **Computes every input's chunk keys** exactly as the connector's worker
   will (:func:`key_namespace`, :func:`object_names`) and asks the store which
   objects it already holds. An input whose chunks are all there is skipped,
   so a warm-up that was interrupted or is run again only writes what is
   missing (a second run of the same inputs writes nothing and says so).
3. **Starts one vLLM producer** (``kv_role: kv_producer``, ``max_tokens=1``) in
   a child process (:class:`lmcache_mooncake.testing.offline.Instance`) and sends it
   the remaining inputs, ``batch_size`` at a time. The producer holds each
   request until its chunks are written to every tier.
4. **Verifies durability**: after the producer has exited, every expected
   object name must exist in the store (polled up to ``verify_timeout_s``). An
   input is reported done only then; anything else is counted as failed. Our
   chunk objects are verified on every read, so a half-written object can
   never be served as a chunk either.

Keys depend on the model id (``model_id`` of the config, else the ``--model``
string exactly as given to vLLM, or its ``--served-model-name``), the KV dtype
(``--dtype``), the model shape, ``chunk_size`` and ``cache_salt``: warm up with
the same values the serving instances use.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import difflib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_mooncake.config import CacheConfig
    from lmcache_mooncake.keys import KeyNamespace
    from lmcache_mooncake.store.client import StoreClient

__all__ = [
    "BadInputError",
    "InputProblem",
    "ModelInfo",
    "PromptRenderer",
    "WarmupError",
    "WarmupInput",
    "WarmupSummary",
    "key_namespace",
    "main_warmup",
    "object_names",
    "read_inputs",
    "warmup",
]

#: The fields of a JSONL line that give the prompt; exactly one per line.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
#: Other fields we read. Any further field is ignored (unless it looks like a typo of ours).
OPTIONAL_FIELDS = ("cache_salt", "id")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt",)
#: Server arguments that would change the chunks' bytes or keys; they have dedicated options.
_REFUSED_SERVER_ARGS = {
    "--model": "give the model with --model",
    "--dtype": "use --dtype",
    "--max-model-len": "use --max-model-len",
    "--kv-cache-dtype": "warm-up stores KV in the model dtype only; serve without --kv-cache-dtype",
    "--tensor-parallel-size": "warm-up runs with tensor parallel size 1 and keys depend on it",
    "-tp": "warm-up runs with tensor parallel size 1 and keys depend on it",
    "--pipeline-parallel-size": "warm-up runs with pipeline parallel size 1",
    "-pp": "warm-up runs with pipeline parallel size 1",
}
_EXISTS_BATCH = 1024


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


class WarmupError(RuntimeError):
    """The warm-up cannot run (model, configuration, store); the message says what to do."""


@dataclass(frozen=True)
class InputProblem:
    """One bad input: where it is and what is wrong with it."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


class BadInputError(WarmupError):
    """A bad input under ``strict=True``; ``problem`` says where."""

    def __init__(self, problem: InputProblem):
        super().__init__(str(problem))
        self.problem = problem


@dataclass
class WarmupInput:
    """One prompt to warm up, rendered to the token ids real requests will carry."""

    source: str
    line: int
    #: "prompt", "prompt_token_ids", "messages" or "document" (a .txt file).
    kind: str
    token_ids: list[int]
    cache_salt: str | None = None
    #: The line's optional "id" field, for the caller's own bookkeeping.
    id: str | None = None
    #: Filled in by :func:`warmup`: "done", "skipped" (already in the store),
    #: "duplicate" (same tokens and salt as an earlier input), "nothing_to_store"
    #: (shorter than a chunk with save_unfull_chunk off), "failed", or
    #: "would_write" (dry run).
    status: str = "pending"
    #: Object names of this input's chunks in the store.
    names: list[str] = field(default_factory=list, repr=False)
    #: How many of ``names`` the store held before the run.
    present_before: int = 0

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass
class WarmupSummary:
    """What a warm-up did (or, for a dry run, would do)."""

    model: str
    model_id: str
    namespace: str
    kv_dtype: str
    chunk_size: int
    dry_run: bool
    #: Good inputs read (bad ones are counted in ``inputs_bad``).
    inputs_total: int = 0
    inputs_done: int = 0
    #: Every chunk was already in the store: nothing to do.
    inputs_skipped: int = 0
    inputs_duplicate: int = 0
    inputs_nothing_to_store: int = 0
    inputs_failed: int = 0
    inputs_bad: int = 0
    #: Dry run: inputs that would be sent to vLLM.
    inputs_to_write: int = 0
    #: Prompt tokens of the inputs sent to vLLM (dry run: that would be sent).
    prompt_tokens: int = 0
    #: Distinct chunks of all good inputs, and how many of them the store held before.
    chunks_total: int = 0
    chunks_present_before: int = 0
    #: Distinct chunks missing before the run (what a run writes; a dry run's estimate).
    chunks_to_write: int = 0
    bytes_estimate: int = 0
    #: What the producer wrote to the store (its ``store_puts`` / ``store_bytes_written`` counters).
    chunks_written: int = 0
    bytes_written: int = 0
    store_put_failures: int = 0
    #: Expected chunks not in the store after the run (0 on success).
    chunks_missing_after: int = 0
    #: Whole command, seconds; the vLLM producer's start-up; the warm-up itself
    #: (first request sent to every chunk verified, without the start-up).
    elapsed_s: float = 0.0
    startup_s: float = 0.0
    warm_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    problems: list[InputProblem] = field(default_factory=list)
    #: "path:line" of every failed input.
    failed: list[str] = field(default_factory=list)
    #: Why the producer stopped early, if it did.
    error: str | None = None
    #: Kept when something failed (or when given): the vLLM log is in it.
    work_dir: str | None = None
    inputs: list[WarmupInput] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """Every good input is in the store (or, for a dry run, could be read)."""
        return self.inputs_failed == 0 and self.error is None

    def to_dict(self, with_inputs: bool = False) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("inputs", "problems")}
        d["problems"] = [str(p) for p in self.problems]
        d["ok"] = self.ok
        if with_inputs:
            d["inputs"] = [
                {"where": i.where, "kind": i.kind, "id": i.id, "tokens": len(i.token_ids), "cache_salt": i.cache_salt,
                 "chunks": len(i.names), "present_before": i.present_before, "status": i.status}
                for i in self.inputs
            ]
        return d

    def format(self) -> str:
        """The human-readable summary the command prints."""
        lines = [f"warm-up summary ({'dry run: nothing was started' if self.dry_run else self.model})"]
        already = f"{self.inputs_skipped} already in the store"
        if self.inputs_duplicate:
            already += f", {self.inputs_duplicate} duplicates"
        if self.inputs_nothing_to_store:
            already += f", {self.inputs_nothing_to_store} shorter than one chunk"
        if self.dry_run:
            lines.append(f"  inputs: {self.inputs_total} read, {self.inputs_to_write} to write, {already}, "
                         f"{self.inputs_bad} bad")
            lines.append(f"  would compute {self.prompt_tokens} prompt tokens and write {self.chunks_to_write} "
                         f"chunks (about {_fmt_bytes(self.bytes_estimate)}); "
                         f"{self.chunks_present_before} of {self.chunks_total} chunks are already in the store")
        else:
            lines.append(f"  inputs: {self.inputs_done} done, {already}, {self.inputs_failed} failed, "
                         f"{self.inputs_bad} bad (skipped)")
            if self.inputs_total == 0:
                lines.append("  no good inputs: nothing to do")
            elif self.inputs_done + self.inputs_failed == 0:
                lines.append(f"  nothing to write: all {self.chunks_total} chunks of the "
                             f"{self.inputs_total} inputs are already in the store; wrote 0 chunks")
            else:
                lines.append(f"  wrote {self.chunks_written} chunks ({_fmt_bytes(self.bytes_written)}) to the store; "
                             f"{self.chunks_present_before} of {self.chunks_total} were there before")
                lines.append(f"  {self.prompt_tokens} prompt tokens in {self.warm_s:.1f} s: "
                             f"{self.prompt_tokens_per_s:.0f} prompt tokens/s "
                             f"(vLLM start-up {self.startup_s:.1f} s, total {self.elapsed_s:.1f} s)")
            if self.chunks_missing_after:
                lines.append(f"  {self.chunks_missing_after} chunks are not in the store after the run"
                             + (f" ({self.store_put_failures} puts failed: is the store full? "
                                "check 'lmcache-mooncake store status')" if self.store_put_failures else ""))
        if self.error:
            lines.append(f"  error: {self.error}")
        for where in self.failed[:20]:
            lines.append(f"  failed: {where}")
        if len(self.failed) > 20:
            lines.append(f"  ... and {len(self.failed) - 20} more failed inputs")
        if self.work_dir:
            lines.append(f"  work folder (vLLM log): {self.work_dir}")
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # not reached


# ---------------------------------------------------------------------------
# Rendering: vLLM's own, without an engine
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What vLLM resolves for the model: all that keys and checks need."""

    model: str
    #: vLLM's served model name (the --model string unless --served-model-name).
    served_model_name: str
    #: Model (and so KV cache) dtype, as torch prints it without "torch.".
    dtype: str
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables that are not set yet, for the duration of the block."""
    added = [k for k in values if k not in os.environ]
    for k in added:
        os.environ[k] = values[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class PromptRenderer:
    """Token ids exactly as vLLM's OpenAI server makes them, built without an engine.

    This is vLLM's ``OnlineRenderer`` (what ``/v1/chat/completions`` and
    ``/v1/completions`` call), set up the way vLLM's CPU-only render server
    (``vllm.entrypoints.launchers.render``) sets it up: the server's own
    argument parser and defaults, ``--model``, ``--dtype``,
    ``--max-model-len``, ``--chat-template`` and any ``server_args`` (options of
    the serving instances that change rendering, e.g.
    ``--chat-template-content-format``, ``--default-chat-template-kwargs``,
    ``--tokenizer``, ``--served-model-name``).
    """

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None,
                 chat_template: str | None = None, server_args: Sequence[str] = ()):
        for arg in server_args:
            name = arg.split("=", 1)[0]
            if name in _REFUSED_SERVER_ARGS:
                raise WarmupError(f"server argument {name}: {_REFUSED_SERVER_ARGS[name]}")
        argv = ["--model", model, "--dtype", dtype]
        if max_model_len:
            argv += ["--max-model-len", str(max_model_len)]
        if chat_template:
            argv += ["--chat-template", chat_template]
        argv += list(server_args)
        with _env(VLLM_LOGGING_LEVEL="WARNING", LMCACHE_LOG_LEVEL="WARNING"):
            from vllm import AsyncEngineArgs
            from vllm.config import ParallelConfig, VllmConfig
            from vllm.entrypoints.launchers.cli_args import (
                make_arg_parser,
                resolve_default_chat_template_kwargs,
            )
            from vllm.renderers import renderer_from_config
            from vllm.renderers.chat_utils import load_chat_template
            from vllm.renderers.online_renderer import OnlineRenderer
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            import lmcache_mooncake.tiers.mooncake  # noqa: F401 - object_names needs it; imported quietly here

            try:
                args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
            except SystemExit as e:
                raise WarmupError(f"vLLM rejected the server arguments {argv[4:]}") from e
            try:
                engine_args = AsyncEngineArgs.from_cli_args(args)
                model_config = engine_args.create_model_config()
                # Rendering only: no quantized kernels, no KV cache (as vLLM's render server).
                model_config.quantization = None
                vllm_config = VllmConfig(
                    model_config=model_config,
                    logging_config=engine_args.create_logging_config(),
                    structured_outputs_config=engine_args.create_structured_outputs_config(),
                )
                renderer = renderer_from_config(vllm_config)
            except Exception as e:  # noqa: BLE001 - any failure here is "vLLM cannot load this model"
                raise WarmupError(f"vLLM cannot load model {model!r}: {e}") from e
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            raise WarmupError(f"KV cache dtype {vllm_config.cache_config.cache_dtype!r} is not supported by warm-up")
        self.model_config = model_config
        self.online = OnlineRenderer(
            model_config=model_config,
            renderer=renderer,
            request_logger=None,
            chat_template=load_chat_template(args.chat_template),
            chat_template_content_format=args.chat_template_content_format,
            trust_request_chat_template=args.trust_request_chat_template,
            trust_request_mm_kwargs=args.trust_request_mm_kwargs,
            enable_auto_tools=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            tool_parser=args.tool_call_parser,
            tool_strict_level=args.tool_strict_level,
            reasoning_parser=args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser,
            default_chat_template_kwargs=resolve_default_chat_template_kwargs(args),
            log_error_stack=False,
        )
        served = model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0]
        parallel = ParallelConfig()
        self.info = ModelInfo(
            model=model,
            served_model_name=str(served or model),
            dtype=str(model_config.dtype).removeprefix("torch."),
            max_model_len=int(model_config.max_model_len),
            num_layers=int(model_config.get_num_layers(parallel)),
            num_kv_heads=int(model_config.get_num_kv_heads(parallel)),
            head_size=int(model_config.get_head_size()),
            vocab_size=int(model_config.get_vocab_size()),
        )
        self._loop = asyncio.new_event_loop()

    def _run(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(coro)
        # Called from inside an event loop (a notebook, an async app): use a thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coro).result()

    def _tokens(self, result: Any) -> list[int]:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            raise ValueError(result.error.message)
        if isinstance(result, tuple):  # render_chat: (conversation, engine inputs)
            result = result[1]
        (engine_input,) = result
        return list(engine_input["prompt_token_ids"])

    def chat(self, messages: list[Any], cache_salt: str | None = None) -> list[int]:
        """Token ids of ``/v1/chat/completions`` with these messages (add_generation_prompt=True)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model=self.info.served_model_name, messages=messages,
                                        max_completion_tokens=1, cache_salt=cache_salt)
        return self._tokens(self._run(self.online.render_chat(request)))

    def text(self, prompt: str, cache_salt: str | None = None) -> list[int]:
        """Token ids of ``/v1/completions`` with this text prompt."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        request = CompletionRequest(model=self.info.served_model_name, prompt=prompt, max_tokens=1,
                                    cache_salt=cache_salt)
        return self._tokens(self._run(self.online.render_completion(request)))

    def close(self) -> None:
        self._loop.close()


# ---------------------------------------------------------------------------
# Reading inputs
# ---------------------------------------------------------------------------


def _too_long(size: str, info: ModelInfo) -> str:
    return (f"prompt too long: it has {size} but the model's context is {info.max_model_len} tokens "
            f"(max_model_len), including 1 output token; shorten or split it, or raise --max-model-len")


def _describe_render_error(e: Exception, info: ModelInfo) -> str:
    """A rendering failure as ``what; what to do``."""
    param, value = getattr(e, "parameter", None), getattr(e, "value", None)
    # vLLM's "longer than the maximum context length", checked on tokens or (first) on characters.
    if param == "input_tokens":
        return _too_long(f"at least {value} tokens", info)
    if param == "input_text":
        return _too_long(f"{value} characters", info)
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    if type(e).__name__ == "ValidationError":  # pydantic: the request is not a valid chat request
        return f"not a valid OpenAI chat request ({first}; {' '.join(t.strip() for t in text[1:3])}); fix the messages"
    return f"cannot render it as vLLM would ({type(e).__name__}: {first}); fix the line"


class _Reader:
    def __init__(self, renderer: PromptRenderer, strict: bool, on_problem: Callable[[InputProblem], None] | None,
                 on_input: Callable[[], None] | None = None):
        self.renderer = renderer
        self.info = renderer.info
        self.strict = strict
        self.on_problem = on_problem
        self.on_input = on_input
        self.inputs: list[WarmupInput] = []
        self.problems: list[InputProblem] = []

    def problem(self, path: str, line: int, message: str) -> None:
        p = InputProblem(path, line, message)
        if self.strict:
            raise BadInputError(p)
        self.problems.append(p)
        if self.on_problem is not None:
            self.on_problem(p)

    def add(self, source: str, line: int, kind: str, tokens: list[int], salt: str | None, ident: Any) -> None:
        if not tokens:
            self.problem(source, line, "empty prompt: it has no tokens; remove it or give a prompt")
            return
        if len(tokens) >= self.info.max_model_len:
            self.problem(source, line, _too_long(f"{len(tokens)} tokens", self.info))
            return
        self.inputs.append(WarmupInput(source, line, kind, tokens, salt, None if ident is None else str(ident)))
        if self.on_input is not None:
            self.on_input()

    # -- one item ----------------------------------------------------------
    def item(self, source: str, line: int, obj: Any) -> None:
        if not isinstance(obj, dict):
            self.problem(source, line, f"expected a JSON object with one of {', '.join(PROMPT_FIELDS)}, "
                         f"got {type(obj).__name__}; write e.g. {{\"prompt\": \"...\"}}")
            return
        for key in obj:
            if key in PROMPT_FIELDS or key in OPTIONAL_FIELDS:
                continue
            close = difflib.get_close_matches(str(key), PROMPT_FIELDS + OPTIONAL_FIELDS, n=1, cutoff=0.75)
            if close:
                self.problem(source, line, f"unknown field {key!r}; did you mean {close[0]!r}?")
                return
        given = [k for k in PROMPT_FIELDS if obj.get(k) is not None]
        if not given:
            self.problem(source, line, f"none of the fields {', '.join(PROMPT_FIELDS)}; give exactly one of them")
            return
        if len(given) > 1:
            self.problem(source, line, f"several prompt fields ({', '.join(given)}); give exactly one per line "
                         "(put each on its own line)")
            return
        salt = obj.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            self.problem(source, line, f"cache_salt must be a non-empty string, got {salt!r}; fix or remove it")
            return
        kind = given[0]
        value = obj[kind]
        if kind == "prompt":
            if not isinstance(value, str):
                self.problem(source, line, f"prompt must be a string, got {type(value).__name__}; "
                             "for token ids use prompt_token_ids")
                return
            if not value.strip():
                self.problem(source, line, "empty prompt; remove the line or give text")
                return
            tokens = self.render(source, line, lambda: self.renderer.text(value, salt))
        elif kind == "prompt_token_ids":
            tokens = self.token_ids(source, line, value)
        else:
            if not isinstance(value, list) or not value:
                self.problem(source, line, "messages must be a non-empty list of {\"role\": ..., \"content\": ...} "
                             "objects; fix the line")
                return
            tokens = self.render(source, line, lambda: self.renderer.chat(value, salt))
        if tokens is not None:
            self.add(source, line, kind, tokens, salt, obj.get("id"))

    def token_ids(self, source: str, line: int, value: Any) -> list[int] | None:
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            self.problem(source, line, "prompt_token_ids must be a list of integers; fix the line")
            return None
        if not value:
            self.problem(source, line, "empty prompt: prompt_token_ids is []; remove the line or give token ids")
            return None
        bad = [t for t in value if not 0 <= t < self.info.vocab_size]
        if bad:
            self.problem(source, line, f"token id {bad[0]} is outside the model's vocabulary "
                         f"[0, {self.info.vocab_size}); were these ids made with another tokenizer?")
            return None
        return list(value)

    def render(self, source: str, line: int, fn: Callable[[], list[int]]) -> list[int] | None:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every rendering failure is a bad input, reported
            self.problem(source, line, _describe_render_error(e, self.info))
            return None

    # -- files -------------------------------------------------------------
    def path(self, path: Path) -> None:
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                           and p.suffix.lower() in JSONL_SUFFIXES + TEXT_SUFFIXES)
            if not files:
                self.problem(str(path), 1, "folder has no .txt or .jsonl files; put documents in it as .txt files")
            for f in files:
                self.file(f)
            return
        self.file(path)

    def file(self, path: Path) -> None:
        suffix = path.suffix.lower()
        if suffix not in JSONL_SUFFIXES + TEXT_SUFFIXES:
            self.problem(str(path), 1, f"not a .jsonl or .txt file ({suffix or 'no suffix'}); "
                         "use .jsonl for prompt lines and .txt for documents")
            return
        try:
            data = path.read_bytes()
        except OSError as e:
            self.problem(str(path), 1, f"cannot read the file ({e.strerror or e}); check the path and permissions")
            return
        if suffix in TEXT_SUFFIXES:
            self.document(path, data)
        else:
            self.jsonl(path, data)

    def document(self, path: Path, data: bytes) -> None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            self.problem(str(path), line, f"not UTF-8 text (byte 0x{data[e.start]:02x}); convert the file to UTF-8")
            return
        if not text.strip():
            self.problem(str(path), 1, "empty document; remove the file or give text")
            return
        tokens = self.render(str(path), 1, lambda: self.renderer.text(text))
        if tokens is not None:
            self.add(str(path), 1, "document", tokens, None, None)

    def jsonl(self, path: Path, data: bytes) -> None:
        source = str(path)
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                self.problem(source, lineno, f"not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                             "convert the file to UTF-8")
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                self.problem(source, lineno, f"malformed JSON ({e.msg} at column {e.colno}); "
                             "each line must be one complete JSON object")
                continue
            self.item(source, lineno, obj)


def read_inputs(
    inputs: Sequence[str | os.PathLike[str] | Mapping[str, Any]],
    renderer: PromptRenderer,
    *,
    strict: bool = False,
    on_problem: Callable[[InputProblem], None] | None = None,
    on_input: Callable[[], None] | None = None,
) -> tuple[list[WarmupInput], list[InputProblem]]:
    """Read and render every input; return the good ones and the problems.

    ``inputs``: paths of ``.jsonl`` files (one JSON object per line with one of
    ``prompt``, ``prompt_token_ids``, ``messages``, and optionally
    ``cache_salt`` and ``id``), ``.txt`` files (one document each) or folders
    of them; or dictionaries shaped like a JSONL line (reported as
    ``<inputs>:N``, N counting from 1). With ``strict`` the first problem
    raises :class:`BadInputError`; else ``on_problem`` is called with each
    problem, and ``on_input`` after each good input.
    """
    reader = _Reader(renderer, strict, on_problem, on_input)
    for i, item in enumerate(inputs):
        if isinstance(item, Mapping):
            reader.item("<inputs>", i + 1, dict(item))
        else:
            reader.path(Path(item))
    return reader.inputs, reader.problems


# ---------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------


def key_namespace(info: ModelInfo, cfg: CacheConfig, model_id: str | None = None) -> KeyNamespace:
    """The namespace the connector's worker derives for this model and config (tensor parallel size 1).

    The worker builds it from its KV cache tensors: dtype, layer count, KV heads
    and head size, with the model id of ``model_id`` / ``cfg.model_id`` / vLLM's
    served model name.
    """
    from lmcache_mooncake.keys import model_identity, namespace_for

    return namespace_for(
        model_identity(model_id or cfg.model_id, info.served_model_name),
        info.dtype, info.num_layers, info.num_kv_heads, info.head_size, cfg.chunk_size,
    )


def object_names(namespace: KeyNamespace, tokens: Sequence[int], cache_salt: str | None = None,
                 include_partial: bool = True) -> list[str]:
    """Store object names of the chunks of ``tokens``, as the Mooncake tier names them."""
    from lmcache_mooncake import keys

    return keys.object_names(namespace, tokens, cache_salt, include_partial=include_partial)


def _chunk_bytes(info: ModelInfo, tokens: int) -> int:
    """Bytes of a stored chunk of ``tokens`` tokens (payload plus an estimated header)."""
    import torch

    itemsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
    return 2 * info.num_layers * tokens * info.num_kv_heads * info.head_size * itemsize + 400


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr(log_path: Path | None) -> Iterator[None]:
    """Send file descriptor 2 to ``log_path`` (Mooncake's native logging writes there) for the block."""
    if log_path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(log_path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _connect(cfg: CacheConfig, log_path: Path | None) -> StoreClient:
    from lmcache_mooncake.engine import store_addresses
    from lmcache_mooncake.store.client import StoreClient
    from lmcache_mooncake.store.launcher import StoreError

    mc = cfg.mooncake
    assert mc is not None
    try:
        addr = store_addresses(mc)
        with _quiet_stderr(log_path):
            return StoreClient.connect(
                addr["master_addr"], addr["metadata_url"], protocol=mc.protocol, rdma_devices=mc.rdma_devices,
                local_buffer_bytes=1 << 20, timeout_s=max(mc.timeout, 5.0), mode=addr.get("mode", "tcp"),
                client_addr=addr.get("client_addr", ""), local_hostname=mc.local_hostname,
            )
    except StoreError as e:
        raise WarmupError(str(e)) from e


def _exists(client: StoreClient, names: Sequence[str]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    names = list(dict.fromkeys(names))
    for i in range(0, len(names), _EXISTS_BATCH):
        part = names[i : i + _EXISTS_BATCH]
        out.update(zip(part, client.batch_exists(part), strict=True))
    return out


# ---------------------------------------------------------------------------
# The warm-up
# ---------------------------------------------------------------------------

_RENDERERS: dict[tuple[Any, ...], PromptRenderer] = {}


def get_renderer(model: str, dtype: str = "auto", max_model_len: int | None = None,
                 chat_template: str | None = None, server_args: Sequence[str] = ()) -> PromptRenderer:
    """A :class:`PromptRenderer`, built once per process for the same arguments."""
    key = (model, dtype, max_model_len, chat_template, tuple(server_args))
    if key not in _RENDERERS:
        _RENDERERS[key] = PromptRenderer(model, dtype, max_model_len, chat_template, server_args)
    return _RENDERERS[key]


def warmup(
    model: str,
    config: str | os.PathLike[str],
    inputs: Sequence[str | os.PathLike[str] | Mapping[str, Any]],
    *,
    overrides: Mapping[str, Any] | None = None,
    model_id: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    chat_template: str | None = None,
    server_args: Sequence[str] = (),
    batch_size: int = 16,
    strict: bool = False,
    dry_run: bool = False,
    kv_cache_gib: int = 2,
    batch_timeout_s: float = 900.0,
    verify_timeout_s: float = 60.0,
    work_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    on_problem: Callable[[InputProblem], None] | None = None,
) -> WarmupSummary:
    """Warm the shared store with ``inputs``; return when every chunk is durable in the store.

    ``model``: the model as the serving instances give it to vLLM (``--model``;
    the string is part of the keys unless ``model_id`` is set). ``config``:
    the producer's cache configuration YAML (it needs a ``mooncake:``
    section); ``overrides``: keys that override it, as in
    ``kv_connector_extra_config``. ``inputs``: see :func:`read_inputs`.
    ``dtype``: the serving instances' ``--dtype`` (the KV dtype is part of the
    keys). ``server_args``: other options of the serving vLLM that change how
    prompts are rendered (see :class:`PromptRenderer`).

    Bad inputs are skipped and counted (``strict``: :class:`BadInputError` at
    the first). With ``dry_run`` nothing is started: the summary says what
    would be written. Raises :class:`WarmupError` when the model, the
    configuration or the store cannot be used.
    """
    from lmcache_mooncake.config import ConfigError, load_config

    t_start = time.monotonic()
    if batch_size < 1:
        raise WarmupError(f"batch size {batch_size} must be at least 1")
    overrides = dict(overrides or {})
    if model_id:
        overrides["model_id"] = model_id
    config_path = Path(config).resolve()
    try:
        cfg = load_config(config_path, overrides=overrides)
    except ConfigError as e:
        raise WarmupError(str(e)) from e
    if cfg.mooncake is None:
        raise WarmupError(f"{config}: warm-up writes to the shared store, but the configuration has no "
                          "'mooncake:' section; use configs/prefill.yaml or add one")

    def note(msg: str) -> None:
        if progress:
            _write(msg)

    if on_problem is None:
        def on_problem(p: InputProblem) -> None:
            note(f"warning: {p}")

    from tqdm import tqdm

    renderer = get_renderer(model, dtype, max_model_len, chat_template, server_args)
    info = renderer.info
    ns = key_namespace(info, cfg)
    summary = WarmupSummary(model=model, model_id=ns.model, namespace=ns.hex(), kv_dtype=ns.kv_dtype,
                            chunk_size=ns.chunk_size, dry_run=dry_run)
    with tqdm(desc="reading inputs", unit="input", file=sys.stderr, disable=not progress, leave=False) as bar:
        good, problems = read_inputs(inputs, renderer, strict=strict, on_problem=on_problem,
                                     on_input=bar.update)
    summary.problems, summary.inputs_bad, summary.inputs_total, summary.inputs = problems, len(problems), len(good), good

    # -- what is in the store already --------------------------------------
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    for item in good:
        key = (item.cache_salt, tuple(item.token_ids))
        if key in seen:
            item.status = "duplicate"
            continue
        seen.add(key)
        item.names = object_names(ns, item.token_ids, item.cache_salt, include_partial=cfg.save_unfull_chunk)
        if not item.names:
            item.status = "nothing_to_store"
    unique = [i for i in good if i.status == "pending"]
    all_names = list(dict.fromkeys(n for i in unique for n in i.names))
    summary.chunks_total = len(all_names)

    own_dir = work_dir is None
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="lmcm-warmup-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = not own_dir
    try:
        try:
            client = _connect(cfg, work / "store-client.log")
        except WarmupError as e:
            if not dry_run:
                raise
            note(f"warning: {e}; reporting as if the store held nothing")
            client = None
        try:
            present = _exists(client, all_names) if client is not None else dict.fromkeys(all_names, False)
            if client is not None and not client.healthy:
                raise WarmupError(f"the Mooncake store did not answer ({client.stats()['last_error']}); "
                                  "check it with 'lmcache-mooncake store status'")
            summary.chunks_present_before = sum(present.values())
            missing = [n for n in all_names if not present[n]]
            summary.chunks_to_write = len(missing)
            # Tokens per missing chunk: chunk_size, or less for a prompt's partial last chunk.
            sizes = dict.fromkeys(missing, ns.chunk_size)
            for i in unique:
                i.present_before = sum(present[n] for n in i.names)
                if i.present_before == len(i.names):
                    i.status = "skipped"
                elif len(i.token_ids) % ns.chunk_size and i.names[-1] in sizes:
                    sizes[i.names[-1]] = len(i.token_ids) % ns.chunk_size
            summary.bytes_estimate = sum(_chunk_bytes(info, t) for t in sizes.values())
            pending = [i for i in unique if i.status == "pending"]
            summary.prompt_tokens = sum(len(i.token_ids) for i in pending)
            if dry_run:
                for i in pending:
                    i.status = "would_write"
                summary.inputs_to_write = len(pending)
            elif pending:
                _produce(summary, pending, model, config_path, overrides, cfg, info, client, work,
                         batch_size, kv_cache_gib, batch_timeout_s, verify_timeout_s, progress)
        finally:
            if client is not None:
                with _quiet_stderr(work / "store-client.log"):
                    client.close()
    except BaseException as e:
        # An interruption or a crash: keep the vLLM log. A WarmupError says all there is.
        keep = not isinstance(e, WarmupError)
        raise
    finally:
        _count(summary)
        if summary.error or summary.inputs_failed:
            keep = True
        if keep:
            summary.work_dir = str(work)
        elif own_dir:
            shutil.rmtree(work, ignore_errors=True)
        summary.elapsed_s = time.monotonic() - t_start
    return summary


def _count(s: WarmupSummary) -> None:
    by = {st: sum(1 for i in s.inputs if i.status == st) for st in
          ("done", "skipped", "duplicate", "nothing_to_store", "failed")}
    s.inputs_done, s.inputs_skipped, s.inputs_duplicate = by["done"], by["skipped"], by["duplicate"]
    s.inputs_nothing_to_store, s.inputs_failed = by["nothing_to_store"], by["failed"]
    s.failed = [i.where for i in s.inputs if i.status == "failed"]


def _write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def _produce(summary: WarmupSummary, pending: list[WarmupInput], model: str, config_path: Path,
             overrides: dict[str, Any], cfg: CacheConfig, info: ModelInfo, client: StoreClient | None,
             work: Path, batch_size: int, kv_cache_gib: int, batch_timeout_s: float, verify_timeout_s: float,
             progress: bool) -> None:
    """Run ``pending`` through one vLLM producer, then check every chunk is in the store."""
    from tqdm import tqdm

    from lmcache_mooncake.stats import read_stats
    from lmcache_mooncake.testing.offline import Instance, RunSpec

    assert client is not None
    run_dir = work / "producer-run"
    extra: dict[str, Any] = {"config_file": str(config_path), **overrides, "run_dir": str(run_dir),
                             "model_id": summary.model_id}
    spec = RunSpec(
        model=model, prompts=[], kv_role="kv_producer", extra_config=extra, max_tokens=1,
        dtype=info.dtype, max_model_len=info.max_model_len, kv_cache_gib=kv_cache_gib,
        prefix_caching=True, timeout_s=batch_timeout_s,
        # Our quiet import settings must not reach the vLLM log.
        env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
             "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "INFO")},
    )
    n_chunks = summary.chunks_to_write
    bar = tqdm(total=len(pending), unit="input", desc="warm-up", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    if progress:
        bar.write(f"starting the vLLM producer for {len(pending)} inputs, {summary.prompt_tokens} prompt tokens, "
                  f"{n_chunks} chunks to write (log: {work / 'vllm' / 'vllm.log'})", file=sys.stderr)
    sent: list[WarmupInput] = []
    tokens = 0
    busy = 0.0
    t_first = t_end = None
    try:
        with Instance(spec, work / "vllm") as inst:
            try:
                for b in range(0, len(pending), batch_size):
                    batch = pending[b : b + batch_size]
                    t0 = time.monotonic()
                    results = inst.run([i.token_ids for i in batch], [i.cache_salt for i in batch])
                    t1 = time.monotonic()
                    if t_first is None:
                        t_first = t0
                        # The first batch also waited for vLLM to start.
                        summary.startup_s = max((t1 - t0) - sum(r.ttft_s for r in results), 0.0)
                    busy += sum(r.ttft_s for r in results)
                    sent.extend(batch)
                    tokens += sum(len(i.token_ids) for i in batch)
                    bar.update(len(batch))
                    bar.set_postfix(tokens=tokens, chunks=read_stats(run_dir).get("store_puts", 0), refresh=True)
                t_end = time.monotonic()
            except RuntimeError as e:
                summary.error = f"the vLLM producer failed: {str(e).splitlines()[0]} (see {inst.log_path})"
            try:
                inst.stop()
            except RuntimeError as e:
                summary.error = summary.error or f"the vLLM producer did not exit cleanly: {str(e).splitlines()[0]}"
        stats = read_stats(run_dir) if run_dir.exists() else {}
        bar.set_postfix(tokens=tokens, chunks=stats.get("store_puts", 0), refresh=True)
    finally:
        bar.close()
    summary.chunks_written = int(stats.get("store_puts", 0))
    summary.bytes_written = int(stats.get("store_bytes_written", 0))
    summary.store_put_failures = int(stats.get("store_put_failures", 0))

    # -- durability: every expected chunk must be in the store --------------
    t_v = time.monotonic()
    names = list(dict.fromkeys(n for i in sent for n in i.names))
    present = _exists(client, names)
    deadline = time.monotonic() + verify_timeout_s
    while not all(present.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        present.update(_exists(client, [n for n, ok in present.items() if not ok]))
    verify_s = time.monotonic() - t_v
    summary.chunks_missing_after = sum(not ok for ok in present.values())
    sent_ids = {id(i) for i in sent}
    for i in pending:
        if id(i) in sent_ids and all(present[n] for n in i.names):
            i.status = "done"
        else:
            i.status = "failed"
    summary.prompt_tokens = tokens
    if t_first is not None:
        end = t_end if t_end is not None else time.monotonic()
        summary.warm_s = max(end - t_first - summary.startup_s, busy) + verify_s
        summary.prompt_tokens_per_s = tokens / summary.warm_s if summary.warm_s > 0 else 0.0


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

_EPILOG = """\
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-mooncake warmup",
        description="Pre-compute the KV cache of known prompts (system prompts, documents, few-shot\n"
        "examples, chat conversations) and store their chunks in the shared Mooncake Store, so that\n"
        "serving instances load them instead of computing them. Inputs are read and tokenized here\n"
        "exactly as vLLM's OpenAI server would; inputs already in the store are skipped; the rest go\n"
        "to one vLLM producer (kv_producer, max_tokens=1) in a child process. Returns when every\n"
        "chunk is verified in the store.",
        epilog=_EPILOG,
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
    p.add_argument("--batch-size", type=int, default=16, help="inputs handed to vLLM at a time (default 16)")
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
    return p


def _parse_set(items: list[str]) -> dict[str, Any]:
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


def main_warmup(argv: list[str] | None = None) -> int:
    import logging

    args = _parser().parse_args(argv)
    progress = not args.no_progress

    def on_problem(p: InputProblem) -> None:  # printed even with --no-progress
        _write(f"warning: {p}")

    try:
        for name in ("vllm", "lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)
        summary = warmup(
            args.model, args.config, args.input,
            overrides=_parse_set(args.set), model_id=args.model_id, dtype=args.dtype,
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


if __name__ == "__main__":
    sys.exit(main_warmup())
