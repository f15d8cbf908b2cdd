"""``lmcache-mooncake warmup`` without a vLLM engine: reading and rendering inputs, bad inputs,
--strict, --dry-run against a real store, and chat rendering equal to vLLM's server rendering."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_mooncake.chunks.keys import KeyNamespace, chunk_keys
from lmcache_mooncake.config import load_config
from lmcache_mooncake.store.client import StoreClient
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store
from lmcache_mooncake.warmup import (
    BadInputError,
    WarmupError,
    get_renderer,
    key_namespace,
    main_warmup,
    object_names,
    read_inputs,
)

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful assistant. " * 60  # about 300 tokens: one full chunk and more
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is in the shared store?"},
    {"role": "assistant", "content": "Chunks of KV cache."},
    {"role": "user", "content": "And who writes them?"},
]


@pytest.fixture(scope="module")
def renderer(model):
    return get_renderer(str(model), "float32")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    sd = tmp_path_factory.mktemp("warmup-store")
    start_store(StoreSpec(memory_bytes=128 << 20, state_dir=sd))
    yield sd
    stop_store(sd)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_reads_each_input_kind(tmp_path, renderer):
    ids = [random.Random(1).randrange(16, 2000) for _ in range(300)]
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "Hello there, general question", "id": "p1"},
        "",  # blank lines are skipped
        {"prompt_token_ids": ids, "cache_salt": "tenant-a"},
        {"messages": MESSAGES, "model": "ignored", "max_tokens": 5},  # other fields are ignored
    ])
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("Second document.\nWith two lines.\n")
    (docs / "sub" / "a.txt").write_text("First document, in a sub-folder.")
    (docs / "notes.md").write_text("not an input")  # other suffixes in a folder are not read
    single = tmp_path / "single.txt"
    single.write_text("A single document given by path.")

    good, problems = read_inputs([f, docs, single, {"prompt": "from python"}], renderer)
    assert problems == []
    assert [(i.source, i.line, i.kind) for i in good] == [
        (str(f), 1, "prompt"), (str(f), 3, "prompt_token_ids"), (str(f), 4, "messages"),
        (str(docs / "b.txt"), 1, "document"), (str(docs / "sub" / "a.txt"), 1, "document"),
        (str(single), 1, "document"), ("<inputs>", 4, "prompt"),
    ]
    assert good[0].id == "p1" and good[1].cache_salt == "tenant-a"
    assert good[1].token_ids == ids
    # Text is tokenized as /v1/completions does: with the tokenizer's special tokens (BOS here).
    bos = 0  # the generated tokenizer's <s>
    assert good[0].token_ids[0] == bos and good[3].token_ids[0] == bos
    assert good[3].token_ids == renderer.text("Second document.\nWith two lines.\n")
    assert good[2].token_ids == renderer.chat(MESSAGES)


def test_each_bad_input_names_file_and_line(tmp_path, renderer):
    max_len = renderer.info.max_model_len
    f = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "fine"},                                   # 1
        '{"prompt": "unterminated',                           # 2 malformed JSON
        {"cache_salt": "x"},                                  # 3 none of the fields
        {"prompt": "a", "prompt_token_ids": [5]},             # 4 several
        {"prompt": ""},                                       # 5 empty
        {"prompt_token_ids": []},                             # 6 empty
        {"prompt_token_ids": [7] * max_len},                  # 7 longer than the context
        {"prompt": "many words here " * 3000},                # 8 longer than the context (text)
        {"prompt_token_ids": [5, 999999]},                    # 9 outside the vocabulary
        {"promt": "typo"},                                    # 10 a typo of a field
        {"prompt": "x", "cache_salt": ""},                    # 11 empty salt
        {"messages": "hello"},                                # 12 messages not a list
        {"messages": [1, 2]},                                 # 13 not chat messages
        '["a", "list"]',                                      # 14 not an object
    ])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "table.csv").write_text("a,b\n")
    missing = tmp_path / "missing.jsonl"
    good, problems = read_inputs([f, tmp_path / "latin1.txt", tmp_path / "empty.txt", tmp_path / "table.csv",
                                  missing], renderer)
    assert [g.line for g in good] == [1]
    expect = [
        (f, 2, "malformed JSON"), (f, 3, "none of the fields"), (f, 4, "several prompt fields"),
        (f, 5, "empty prompt"), (f, 6, "empty prompt"), (f, 7, "prompt too long"), (f, 8, "prompt too long"),
        (f, 9, "outside the model's vocabulary"), (f, 10, "did you mean 'prompt'"), (f, 11, "cache_salt"),
        (f, 12, "messages must be a non-empty list"), (f, 13, "not a valid OpenAI chat request"),
        (f, 14, "expected a JSON object"),
        (tmp_path / "latin1.txt", 1, "not UTF-8"), (tmp_path / "empty.txt", 1, "empty document"),
        (tmp_path / "table.csv", 1, "not a .jsonl or .txt file"), (missing, 1, "cannot read the file"),
    ]
    assert len(problems) == len(expect), "\n".join(map(str, problems))
    for p, (path, line, what) in zip(problems, expect, strict=True):
        text = str(p)
        assert text.startswith(f"{path}:{line}: "), text
        assert what in text, text
        assert "; " in text, f"no advice in: {text}"  # "what; what to do"
    assert f"{max_len} tokens (max_model_len)" in str(problems[5])


def test_strict_stops_at_the_first_bad_input(tmp_path, renderer, capsys):
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "fine"}, "{not json", {}])
    with pytest.raises(BadInputError) as err:
        read_inputs([f], renderer, strict=True)
    assert err.value.problem.line == 2
    rc = main_warmup(["--model", renderer.info.model, "--config", str(REPO / "configs/prefill.yaml"),
                      "--dtype", "float32", "--input", str(f), "--strict", "--no-progress"])
    assert rc == 2
    err_text = capsys.readouterr().err
    assert f"{f}:2: malformed JSON" in err_text and f"{f}:3:" not in err_text
    assert "nothing was written" in err_text


def test_dry_run_reports_what_would_be_written_and_starts_nothing(tmp_path, renderer, store, capsys):
    rng = random.Random(4)
    a = [rng.randrange(16, 2000) for _ in range(600)]   # 2 full chunks + 88 tokens
    b = [rng.randrange(16, 2000) for _ in range(256)]   # 1 full chunk
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt_token_ids": a}, {"prompt_token_ids": b}, {"prompt_token_ids": b},  # line 3: a duplicate
        {"messages": MESSAGES}, {"oops": 1},
    ])
    cfg = load_config(REPO / "configs/prefill.yaml")
    ns = key_namespace(renderer.info, cfg)
    # Pretend an earlier warm-up stored b: its chunk exists, so b is skipped (resumable).
    client = StoreClient.from_state(store, timeout_s=2.0)
    try:
        assert client.batch_put(object_names(ns, b), [b"x"]) == [0]
    finally:
        client.close()
    out_json = tmp_path / "summary.json"
    rc = main_warmup(["--model", renderer.info.model, "--config", str(REPO / "configs/prefill.yaml"),
                      "--dtype", "float32", "--input", str(f), "--dry-run", "--no-progress",
                      "--set", f"mooncake.store_dir={store}", "--summary-json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr()
    chat_tokens = renderer.chat(MESSAGES)
    tokens = len(a) + len(chat_tokens)
    chunks = 3 + -(-len(chat_tokens) // 256)
    assert "dry run: nothing was started" in out.out
    assert "inputs: 4 read, 2 to write, 1 already in the store, 1 duplicates, 1 bad" in out.out
    assert f"would compute {tokens} prompt tokens and write {chunks} chunks" in out.out
    assert f"{out_json.parent}" not in out.out  # no work folder kept: nothing ran
    assert f"{f}:5: unknown field" not in out.err and f"{f}:5: none of the fields" in out.err
    s = json.loads(out_json.read_text())
    assert s["dry_run"] and s["inputs_to_write"] == 2 and s["inputs_skipped"] == 1 and s["inputs_bad"] == 1
    assert s["chunks_to_write"] == chunks and s["chunks_present_before"] == 1
    assert s["chunks_written"] == 0 and s["work_dir"] is None
    # float32, 4 layers, 2 KV heads of 64: 256 tokens are 1 MiB of KV.
    assert s["bytes_estimate"] >= (2 * 4 * 128 * 4) * (len(a) + len(chat_tokens))
    assert [i["status"] for i in s["inputs"]] == ["would_write", "skipped", "duplicate", "would_write"]


def test_chat_rendering_equals_vllm_server_rendering(renderer):
    """The token ids warm-up stores for ``messages`` are those vLLM's OpenAI server makes for
    /v1/chat/completions: compared with the renderer vLLM's own server start-up builds, and with
    the chat template applied by vLLM's template function."""
    from starlette.datastructures import State
    from vllm import AsyncEngineArgs
    from vllm.config import VllmConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.render.app_state import init_render_app_state
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = renderer.info.model
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, "--dtype", "float32"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    vllm_config = VllmConfig(model_config=model_config, logging_config=engine_args.create_logging_config(),
                             structured_outputs_config=engine_args.create_structured_outputs_config())
    state = State()
    conversations = [MESSAGES[:2], MESSAGES, [{"role": "user", "content": "only a user turn"}],
                     [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": [{"type": "text", "text": "content as parts"}]}]]

    async def server_render():
        await init_render_app_state(vllm_config, state, args)
        out = []
        for messages in conversations:
            _, (engine_input,) = await state.online_renderer.render_chat(
                ChatCompletionRequest(model=model, messages=messages))
            out.append(engine_input["prompt_token_ids"])
        (text_input,) = await state.online_renderer.render_completion(
            CompletionRequest(model=model, prompt="a text prompt"))
        return out, text_input["prompt_token_ids"]

    server_chats, server_text = asyncio.run(server_render())
    tokenizer = state.online_renderer.renderer.get_tokenizer()
    for messages, server in zip(conversations, server_chats, strict=True):
        ours = renderer.chat(messages)
        assert ours == server
        if isinstance(messages[-1]["content"], str):
            text = safe_apply_chat_template(model_config, tokenizer, messages, add_generation_prompt=True,
                                            tokenize=False)
            assert ours == tokenizer.encode(text, add_special_tokens=False)
    assert renderer.text("a text prompt") == server_text


def test_namespace_and_object_names(renderer):
    cfg = load_config(REPO / "configs/prefill.yaml")
    ns = key_namespace(renderer.info, cfg)
    # What the tiny model's worker builds from its KV cache: float32, 4 layers, 2 KV heads of 64,
    # and on this CPU build CPU_ATTN's 128-token blocks, which chunks of 256 keep as they are.
    assert (renderer.info.kv_backend, renderer.info.block_size) == ("CPU_ATTN", 128)
    assert ns == KeyNamespace(model=renderer.info.model, kv_dtype="float32", num_layers=4, num_kv_heads=2,
                              head_size=64, chunk_size=256, chunk_layout="blocks")
    tokens = list(range(16, 16 + 600))
    want = [f"lmcm/{ns.hex()}/{k.hex}" for k in chunk_keys(ns, tokens, "s")]
    assert object_names(ns, tokens, "s") == want and len(want) == 3
    assert len(object_names(ns, tokens, "s", include_partial=False)) == 2
    assert key_namespace(renderer.info, cfg, model_id="my-model").model == "my-model"


def test_refusals(tmp_path, renderer, capsys):
    with pytest.raises(WarmupError, match="kv-cache-dtype"):
        get_renderer(renderer.info.model, "float32", server_args=["--kv-cache-dtype=fp8"])
    f = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    rc = main_warmup(["--model", renderer.info.model, "--config", str(REPO / "configs/local.yaml"),
                      "--input", str(f), "--dtype", "float32"])
    assert rc == 2 and "no 'mooncake:' section" in capsys.readouterr().err


def test_pin_flags_become_the_mooncake_pin_keys():
    import argparse

    from lmcache_mooncake.warmup.cli import _overrides

    def ns(**kw):
        return argparse.Namespace(**{"set": [], "pin": None, "pin_ttl": None, **kw})

    assert _overrides(ns()) == {}
    assert _overrides(ns(pin="hard")) == {"mooncake": {"pin": "hard"}}
    assert _overrides(ns(pin="soft", pin_ttl=60.0, set=["mooncake.store_dir=/s"])) == {
        "mooncake": {"store_dir": "/s", "pin": "soft", "pin_ttl": 60.0}}
    with pytest.raises(WarmupError, match="--pin-ttl needs --pin soft"):
        _overrides(ns(pin_ttl=5.0))
    cfg = load_config(REPO / "configs/prefill.yaml", overrides=_overrides(ns(pin="soft", pin_ttl=60.0)))
    assert (cfg.mooncake.pin, cfg.mooncake.pin_ttl) == ("soft", 60.0)


def test_help_explains_inputs_and_gives_an_example(capsys):
    with pytest.raises(SystemExit) as e:
        main_warmup(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("prompt_token_ids", "messages", "cache_salt", ".txt", "--dry-run", "--strict", "--summary-json",
                 "--batch-size", "path:line", "example:", "lmcache-mooncake warmup --model", "exit codes"):
        assert word in out, word


# Shapes, dtypes, chunk sizes and tensor parallel layouts the worker supports.
_SHAPES = st.fixed_dictionaries({
    "model_id": st.one_of(st.none(), st.text(min_size=1, max_size=12)),
    "served": st.text(min_size=1, max_size=12),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16"]),
    "num_layers": st.integers(1, 6),
    "num_kv_heads": st.sampled_from([1, 2, 4, 8]),
    "head_size": st.sampled_from([32, 64, 80, 128]),
    "chunk_size": st.sampled_from([16, 64, 256, 512]),
    "tp_size": st.sampled_from([1, 2, 4, 8]),
    "salt": st.one_of(st.none(), st.text(min_size=1, max_size=6)),
    "n_tokens": st.integers(1, 1100),
    # (attention backend, block size): chunks of CPU_ATTN's vec kernels keep its blocks' bytes.
    "backend": st.sampled_from([("FLASH_ATTN", 16), ("CPU_ATTN", 128), ("CPU_ATTN", 16)]),
})


def _worker_namespace(monkeypatch, tmp_path, s: dict, tp_rank: int) -> KeyNamespace:
    """The namespace the connector's worker builds from its KV tensors, with the engine stubbed out."""
    import torch

    from lmcache_mooncake.chunks.keys import model_identity
    from lmcache_mooncake.config import CacheConfig
    from lmcache_mooncake.connector import worker

    monkeypatch.setattr(worker, "build_engine", lambda *a, **k: None)
    monkeypatch.setattr(worker, "LookupServer", lambda *a, **k: None)
    cfg = CacheConfig(chunk_size=s["chunk_size"], model_id=s["model_id"])
    backend, block = s["backend"]
    side = worker.WorkerSide(cfg, model_identity(s["model_id"], s["served"]), backend, block, tmp_path,
                             tmp_path / "lookup.sock", "test", tp_rank=tp_rank, tp_size=s["tp_size"])
    heads = max(1, s["num_kv_heads"] // s["tp_size"])  # vLLM's split of KV heads over ranks
    dtype = getattr(torch, s["dtype"])
    side.register_kv_caches({f"layer{i}": torch.zeros(1, heads, block, 2 * s["head_size"], dtype=dtype)
                             for i in range(s["num_layers"])})
    assert side.namespace is not None
    return side.namespace


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=_SHAPES, data=st.data())
def test_warmup_names_equal_the_workers_names(monkeypatch, tmp_path, s, data):
    """Warm-up's namespace and object names are the worker's, for every shape, dtype, chunk size and
    tensor parallel rank: keys.namespace_for + keys.object_names, and the worker's own path from its
    KV tensors."""
    from lmcache_mooncake.chunks import keys
    from lmcache_mooncake.config import CacheConfig
    from lmcache_mooncake.warmup import ModelInfo

    tp_rank = data.draw(st.integers(0, s["tp_size"] - 1))
    info = ModelInfo(model=s["served"], served_model_name=s["served"], dtype=s["dtype"], max_model_len=4096,
                     num_layers=s["num_layers"], num_kv_heads=s["num_kv_heads"], head_size=s["head_size"],
                     vocab_size=2048, kv_backend=s["backend"][0], block_size=s["backend"][1])
    cfg = CacheConfig(chunk_size=s["chunk_size"], model_id=s["model_id"])
    ns = key_namespace(info, cfg, tp_size=s["tp_size"], tp_rank=tp_rank)
    direct = keys.namespace_for(keys.model_identity(s["model_id"], s["served"]), s["dtype"], s["num_layers"],
                                max(1, s["num_kv_heads"] // s["tp_size"]), s["head_size"], s["chunk_size"],
                                tp_size=s["tp_size"], tp_rank=tp_rank, chunk_layout=ns.chunk_layout)
    assert ns == direct
    assert ns == _worker_namespace(monkeypatch, tmp_path, s, tp_rank)
    tokens = list(range(16, 16 + s["n_tokens"]))
    for partial in (True, False):
        assert object_names(ns, tokens, s["salt"], include_partial=partial) == keys.object_names(
            direct, tokens, s["salt"], None, include_partial=partial)
    # Tensor parallel size 1 (what the warm-up command writes) is the default.
    if s["tp_size"] == 1:
        assert key_namespace(info, cfg) == ns


def test_batches_keep_inputs_that_share_a_chunk_apart():
    from lmcache_mooncake.warmup.producer import batches
    from lmcache_mooncake.warmup.summary import WarmupInput

    def inp(line: int, *names: str) -> WarmupInput:
        return WarmupInput(source="f.jsonl", line=line, kind="prompt", token_ids=[1], names=list(names))

    a, b, c, d, e = inp(1, "p", "a"), inp(2, "p", "b"), inp(3, "c"), inp(4, "p", "d"), inp(5, "e")
    got = [[i.line for i in batch] for batch in batches([a, b, c, d, e], 3)]
    assert got == [[1, 3, 5], [2], [4]]  # 2 and 4 share chunk "p" with 1, and with each other
    assert [[i.line for i in batch] for batch in batches([c, e, a], 2)] == [[3, 5], [1]]
    assert batches([], 4) == []
