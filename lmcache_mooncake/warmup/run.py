"""The warm-up itself: read, plan, produce, verify; :func:`warmup` returns the :class:`WarmupSummary`."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcache_mooncake.warmup.inputs import read_inputs
from lmcache_mooncake.warmup.planning import (
    connect,
    exists,
    key_namespace,
    mark_present,
    name_inputs,
    quiet_stderr,
)
from lmcache_mooncake.warmup.producer import ProducerSettings, produce
from lmcache_mooncake.warmup.rendering import PromptRenderer, get_renderer
from lmcache_mooncake.warmup.summary import InputProblem, WarmupError, WarmupSummary, count_statuses


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
    renderer: PromptRenderer | None = None,
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

    ``renderer``: a :class:`PromptRenderer` built for the same model, dtype,
    context length, chat template and server arguments (default: the one
    :func:`get_renderer` keeps for them).

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
            write_progress(msg)

    if on_problem is None:
        def on_problem(p: InputProblem) -> None:
            note(f"warning: {p}")

    from tqdm import tqdm

    if renderer is None:
        renderer = get_renderer(model, dtype, max_model_len, chat_template, server_args)
    info = renderer.info
    ns = key_namespace(info, cfg)
    summary = WarmupSummary(model=model, model_id=ns.model, namespace=ns.hex(), kv_dtype=ns.kv_dtype,
                            chunk_size=ns.chunk_size, dry_run=dry_run)
    with tqdm(desc="reading inputs", unit="input", file=sys.stderr, disable=not progress, leave=False) as bar:
        good, problems = read_inputs(inputs, renderer, strict=strict, on_problem=on_problem,
                                     on_input=bar.update)
    summary.problems, summary.inputs_bad, summary.inputs_total, summary.inputs = problems, len(problems), len(good), good
    unique = name_inputs(good, ns, include_partial=cfg.save_unfull_chunk)
    all_names = list(dict.fromkeys(n for i in unique for n in i.names))
    summary.chunks_total = len(all_names)

    own_dir = work_dir is None
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="lmcm-warmup-"))
    work.mkdir(parents=True, exist_ok=True)
    keep = not own_dir
    try:
        try:
            client = connect(cfg, work / "store-client.log")
        except WarmupError as e:
            if not dry_run:
                raise
            note(f"warning: {e}; reporting as if the store held nothing")
            client = None
        try:
            present = exists(client, all_names) if client is not None else dict.fromkeys(all_names, False)
            if client is not None and not client.healthy:
                raise WarmupError(f"the Mooncake store did not answer ({client.stats()['last_error']}); "
                                  "check it with 'lmcache-mooncake store status'")
            pending = mark_present(summary, unique, present, ns, info)
            if dry_run:
                for i in pending:
                    i.status = "would_write"
                summary.inputs_to_write = len(pending)
            elif pending:
                if client is None:
                    raise WarmupError("no store client to verify the producer's writes")  # connect() raised before
                produce(summary, pending, client, ProducerSettings(
                    model=model, config_path=config_path, info=info, work=work, overrides=overrides,
                    batch_size=batch_size, kv_cache_gib=kv_cache_gib, batch_timeout_s=batch_timeout_s,
                    verify_timeout_s=verify_timeout_s, progress=progress,
                ))
        finally:
            if client is not None:
                with quiet_stderr(work / "store-client.log"):
                    client.close()
    except BaseException as e:
        # An interruption or a crash: keep the vLLM log. A WarmupError says all there is.
        keep = not isinstance(e, WarmupError)
        raise
    finally:
        count_statuses(summary)
        if summary.error or summary.inputs_failed:
            keep = True
        if keep:
            summary.work_dir = str(work)
        elif own_dir:
            shutil.rmtree(work, ignore_errors=True)
        summary.elapsed_s = time.monotonic() - t_start
    return summary


def write_progress(msg: str) -> None:
    """A line on stderr that does not break a progress bar."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
