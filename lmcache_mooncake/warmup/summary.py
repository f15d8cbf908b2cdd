"""What a warm-up reports: its errors, its inputs' fates and the summary it prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lmcache_mooncake.runtime.procs import format_bytes


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
    #: What the producer wrote to the store (``vllm:lmcm_chunks_written`` / ``vllm:lmcm_written_bytes``, tier store).
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
    #: Part of ``warm_s``: the final check, from the last result to every chunk seen in the store.
    durable_s: float = 0.0
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
                         f"chunks (about {format_bytes(self.bytes_estimate)}); "
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
                lines.append(f"  wrote {self.chunks_written} chunks ({format_bytes(self.bytes_written)}) to the store; "
                             f"{self.chunks_present_before} of {self.chunks_total} were there before")
                lines.append(f"  {self.prompt_tokens} prompt tokens in {self.warm_s:.1f} s: "
                             f"{self.prompt_tokens_per_s:.0f} prompt tokens/s "
                             f"(vLLM start-up {self.startup_s:.1f} s, durability check {self.durable_s:.2f} s, "
                             f"total {self.elapsed_s:.1f} s)")
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


#: The final statuses of an input that :func:`count_statuses` counts.
FINAL_STATUSES = ("done", "skipped", "duplicate", "nothing_to_store", "failed")


def count_statuses(s: WarmupSummary) -> None:
    """Fill the summary's ``inputs_*`` counters and ``failed`` list from its inputs' statuses."""
    by = {st: sum(1 for i in s.inputs if i.status == st) for st in FINAL_STATUSES}
    s.inputs_done, s.inputs_skipped, s.inputs_duplicate = by["done"], by["skipped"], by["duplicate"]
    s.inputs_nothing_to_store, s.inputs_failed = by["nothing_to_store"], by["failed"]
    s.failed = [i.where for i in s.inputs if i.status == "failed"]
