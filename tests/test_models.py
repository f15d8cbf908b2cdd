"""Tests for lmcache_mooncake.testing.models: deterministic hub-free model folders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmcache_mooncake.testing.models import (
    MARKER,
    SIZES,
    ModelSpec,
    _publish,
    build_model,
    default_cache_dir,
    main_make_model,
    model_dir_name,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = ModelSpec()  # llama, tiny, seed 0, vocab 2048


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(TINY, tmp_path_factory.mktemp("cache_a"))


@pytest.fixture(scope="module")
def tiny_dir_again(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(TINY, tmp_path_factory.mktemp("cache_b"))


def test_folder_layout(tiny_dir: Path) -> None:
    assert tiny_dir.name == "llama-tiny-s0-v2048"
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER} <= names
    assert json.loads((tiny_dir / MARKER).read_text())["spec"]["seed"] == 0
    # No temp/trash siblings survive a successful build.
    assert [p.name for p in tiny_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_same_spec_is_byte_identical(tiny_dir: Path, tiny_dir_again: Path) -> None:
    a, b = _digests(tiny_dir), _digests(tiny_dir_again)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert a[name] == b[name], name
    assert a == b


def test_different_seed_changes_only_weights(tiny_dir: Path, tmp_path: Path) -> None:
    import torch

    rng_state = torch.random.get_rng_state()
    other = build_model(ModelSpec(seed=1), tmp_path)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # caller's RNG untouched
    assert other.name == "llama-tiny-s1-v2048"
    a, b = _digests(tiny_dir), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    # The tokenizer depends on vocab_size only, so prompts tokenize the same.
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_reuse_does_not_rewrite(tiny_dir: Path) -> None:
    before = _mtimes(tiny_dir)
    start = time.monotonic()
    again = build_model(TINY, tiny_dir.parent)
    assert again == tiny_dir
    assert time.monotonic() - start < 0.5
    assert _mtimes(tiny_dir) == before


def test_incomplete_folder_is_replaced(tiny_dir: Path, tmp_path: Path) -> None:
    # A folder without a matching marker (crash debris, old format) is rebuilt.
    target = tmp_path / model_dir_name(TINY)
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / MARKER).write_text(json.dumps({"format": -1}))
    crashed = tmp_path / f".{target.name}.tmp-crashed"  # temp folder of a killed builder
    crashed.mkdir()
    assert build_model(TINY, tmp_path) == target
    assert _digests(target) == _digests(tiny_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{target.name}.lock", target.name]


def test_force_rebuilds(tmp_path: Path) -> None:
    folder = build_model(TINY, tmp_path)
    before = _mtimes(folder)
    time.sleep(0.01)
    assert build_model(TINY, tmp_path, force=True) == folder
    after = _mtimes(folder)
    assert after.keys() == before.keys()
    assert all(after[k] != before[k] for k in before)


def test_fresh_process_builds_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    # A fresh interpreter has new hash seeds and thread pools, so this checks
    # that tokenizer training and weight init do not depend on process state.
    code = (
        "import sys; from pathlib import Path; "
        "from lmcache_mooncake.testing.models import ModelSpec, build_model; "
        "print(build_model(ModelSpec(), Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, env=env, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert folder == tmp_path / tiny_dir.name
    assert _digests(folder) == _digests(tiny_dir)


def test_concurrent_builders_share_one_folder(tiny_dir: Path, tmp_path: Path) -> None:
    # flock conflicts between separate open()s even within one process, so
    # threads exercise the same locking as racing processes.
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = set(pool.map(lambda _: build_model(TINY, tmp_path), range(3)))
    assert paths == {tmp_path / tiny_dir.name}
    assert _digests(tmp_path / tiny_dir.name) == _digests(tiny_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{tiny_dir.name}.lock", tiny_dir.name]


def test_publish_when_target_appeared(tiny_dir: Path, tmp_path: Path) -> None:
    # The lock-free fallback: if another builder renamed its folder into place
    # first, the loser keeps the winner's folder (unless replacing on purpose).
    target = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, target)
    before = _mtimes(target)
    loser = tmp_path / "loser"
    shutil.copytree(tiny_dir, loser)
    _publish(loser, target, TINY, replace=False)
    assert _mtimes(target) == before and loser.exists()

    (loser / "config.json").write_text("{}")  # mark the copy so we can tell them apart
    _publish(loser, target, TINY, replace=True)
    assert (target / "config.json").read_text() == "{}" and not loser.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny_dir.name]


def test_transformers_loads_tokenizer_and_config(tiny_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == len(tok) == 2048
    assert config.max_position_embeddings == 4096
    assert config.initializer_range == pytest.approx(0.1)
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [4, 5]
    assert tok.unk_token == "<unk>"

    text = "The capital of France is Paris, 42 times!\nTabs\tand ünïcödé 🙂 too."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode())  # merges actually compress

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(chat_ids, list):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == tok.bos_token_id and chat_ids.count(4) == 3


def test_greedy_generation_is_prompt_dependent(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    outputs = []
    for prompt in ("The quick brown fox jumps over the lazy dog", "Mooncake stores chunks of KV cache 12345"):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        outputs.append(out[0, ids.shape[1] :].tolist())
    assert outputs[0] != outputs[1]
    assert len(set(outputs[0])) > 1  # not a constant token


def test_qwen2_builds_and_runs(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = build_model(ModelSpec(arch="qwen2"), tmp_path)
    assert folder.name == "qwen2-tiny-s0-v2048"
    assert AutoConfig.from_pretrained(folder).architectures == ["Qwen2ForCausalLM"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 10, 20, 30]])).logits
    assert logits.shape == (1, 4, 2048) and torch.isfinite(logits).all()


def test_half_b_shape_param_count() -> None:
    # Checks the 0.5b preset without materialising ~0.7 GB of weights.
    import torch
    from transformers import AutoModelForCausalLM

    from lmcache_mooncake.testing.models import _make_config

    config = _make_config(ModelSpec(arch="qwen2", size="0.5b"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 361_568_128
    assert SIZES["0.5b"]["hidden_size"] // SIZES["0.5b"]["num_attention_heads"] == 64


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"arch": "gpt2"}, "arch"),
        ({"size": "huge"}, "size"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ],
)
def test_bad_spec_raises(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"ModelSpec\.{field}\b"):
        ModelSpec(**kwargs)  # type: ignore[arg-type]


def test_names_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert (
        model_dir_name(ModelSpec(arch="qwen2", size="0.5b", seed=7, vocab_size=4096)) == "qwen2-0.5b-s7-v4096"
    )
    assert model_dir_name(ModelSpec(max_position_embeddings=512)) == "llama-tiny-s0-v2048-p512"
    monkeypatch.setenv("LMCACHE_MOONCAKE_MODEL_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LMCACHE_MOONCAKE_MODEL_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "lmcache-mooncake" / "models"


def test_cli_prints_path_last(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_make_model(["--out", str(tiny_dir.parent)]) == 0  # reuses the built folder
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == str(tiny_dir)
    assert "reused llama-tiny-s0-v2048" in err and "M params" in err and "MiB on disk" in err

    with pytest.raises(SystemExit) as exc:
        main_make_model(["--help"])
    assert exc.value.code == 0
    assert "--vocab-size" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:
        main_make_model(["--vocab-size", "10", "--out", str(tiny_dir.parent)])
    assert exc.value.code == 2
    assert "vocab_size" in capsys.readouterr().err
