"""Token ids exactly as vLLM's OpenAI server makes them, without an engine (:class:`PromptRenderer`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_mooncake.warmup.summary import WarmupError

#: Server arguments that would change the chunks' bytes or keys; they have dedicated options.
REFUSED_SERVER_ARGS = {
    "--model": "give the model with --model",
    "--dtype": "use --dtype",
    "--max-model-len": "use --max-model-len",
    "--kv-cache-dtype": "warm-up stores KV in the model dtype only; serve without --kv-cache-dtype",
    "--tensor-parallel-size": "warm-up runs with tensor parallel size 1 and keys depend on it",
    "-tp": "warm-up runs with tensor parallel size 1 and keys depend on it",
    "--pipeline-parallel-size": "warm-up runs with pipeline parallel size 1",
    "-pp": "warm-up runs with pipeline parallel size 1",
}


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
    #: The attention backend and block size the serving workers will have on this platform
    #: ("" and 0 where unknown): the chunk layout in the key namespace depends on them.
    kv_backend: str = ""
    block_size: int = 0


def _platform_backend() -> str:
    """The attention backend vLLM's workers use on this platform: ``CPU_ATTN`` on the CPU build;
    "" elsewhere (the GPU backends keep token-major chunks, whichever vLLM picks)."""
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else ""


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
            if name in REFUSED_SERVER_ARGS:
                raise WarmupError(f"server argument {name}: {REFUSED_SERVER_ARGS[name]}")
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
            kv_backend=_platform_backend(),
            block_size=int(vllm_config.cache_config.block_size or 0),
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


@functools.lru_cache(maxsize=4)
def _cached_renderer(model: str, dtype: str, max_model_len: int | None, chat_template: str | None,
                     server_args: tuple[str, ...]) -> PromptRenderer:
    return PromptRenderer(model, dtype, max_model_len, chat_template, server_args)


def get_renderer(model: str, dtype: str = "auto", max_model_len: int | None = None,
                 chat_template: str | None = None, server_args: Sequence[str] = ()) -> PromptRenderer:
    """A :class:`PromptRenderer`, built once per process for the same arguments (the last 4 kept).

    Building one loads the model's tokenizer and configuration through vLLM
    (seconds); :func:`~lmcache_mooncake.warmup.warmup` and the tests reuse it.
    """
    return _cached_renderer(model, dtype, max_model_len, chat_template, tuple(server_args))
