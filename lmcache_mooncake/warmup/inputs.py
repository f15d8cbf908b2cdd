"""Reading warm-up inputs (JSONL lines, .txt documents, folders, dictionaries) into rendered token ids.

Every bad input becomes an :class:`~lmcache_mooncake.warmup.summary.InputProblem`
that says ``path:line: what; what to do``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcache_mooncake.warmup.rendering import ModelInfo, PromptRenderer
from lmcache_mooncake.warmup.summary import BadInputError, InputProblem, WarmupInput

#: The fields of a JSONL line that give the prompt; exactly one per line.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
#: Other fields we read. Any further field is ignored (unless it looks like a typo of ours).
OPTIONAL_FIELDS = ("cache_salt", "id")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt",)


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
