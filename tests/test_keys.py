"""Chunk keys: stable across processes, separated by namespace and salt."""

import subprocess
import sys

from lmcache_mooncake.chunks.keys import KeyNamespace, chunk_keys

NS = KeyNamespace(model="m", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64, chunk_size=256)
TOKENS = list(range(1000, 1000 + 700))

_SCRIPT = """
from lmcache_mooncake.chunks.keys import KeyNamespace, chunk_keys
ns = KeyNamespace(model="m", kv_dtype="bfloat16", num_layers=4, num_kv_heads=2, head_size=64, chunk_size=256)
print(",".join(k.hex for k in chunk_keys(ns, list(range(1000, 1700)), "s")))
"""


def test_keys_identical_in_separate_processes():
    outs = set()
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
        outs.add(out.stdout.strip())
    assert len(outs) == 1
    assert outs.pop() == ",".join(k.hex for k in chunk_keys(NS, TOKENS, "s"))


def test_chunking_and_partial_tail():
    keys = chunk_keys(NS, TOKENS)
    assert [(k.start, k.end) for k in keys] == [(0, 256), (256, 512), (512, 700)]
    assert len(chunk_keys(NS, TOKENS, include_partial=False)) == 2


def test_prefix_property():
    a = chunk_keys(NS, TOKENS)
    b = chunk_keys(NS, TOKENS[:300] + [7] * 400)  # diverges mid-chunk 1
    assert a[0] == b[0]
    assert a[1].digest != b[1].digest and a[2].digest != b[2].digest


def test_namespace_salt_and_lora_separate_keys():
    base = chunk_keys(NS, TOKENS)[0].digest
    variants = [
        chunk_keys(KeyNamespace(**{**NS.__dict__, "model": "other"}), TOKENS)[0],
        chunk_keys(KeyNamespace(**{**NS.__dict__, "kv_dtype": "float32"}), TOKENS)[0],
        chunk_keys(KeyNamespace(**{**NS.__dict__, "num_layers": 5}), TOKENS)[0],
        chunk_keys(KeyNamespace(**{**NS.__dict__, "tp_size": 2}), TOKENS)[0],
        chunk_keys(KeyNamespace(**{**NS.__dict__, "chunk_layout": "blocks"}), TOKENS)[0],
        chunk_keys(NS, TOKENS, cache_salt="tenant-a")[0],
        chunk_keys(NS, TOKENS, lora="adapter")[0],
    ]
    digests = {v.digest for v in variants}
    assert base not in digests and len(digests) == len(variants)
    # The same salt gives the same keys; an empty salt is not "no salt".
    assert chunk_keys(NS, TOKENS, "tenant-a") == chunk_keys(NS, TOKENS, "tenant-a")
    assert chunk_keys(NS, TOKENS, "")[0] != chunk_keys(NS, TOKENS)[0]


def test_names_use_the_full_width_key_and_namespace():
    """Two chunk keys that agree in their first 64 bits are different objects and files."""
    from lmcache_mooncake.chunks.keys import ChunkKey, file_name, object_name

    a = ChunkKey(bytes(8) + b"\x01" * 24, 0, 256)
    b = ChunkKey(bytes(8) + b"\x02" * 24, 0, 256)
    assert a.digest[:8] == b.digest[:8]
    assert object_name(NS, a) != object_name(NS, b) and file_name(NS, a) != file_name(NS, b)
    assert object_name(NS, a) == f"lmcm/{NS.digest().hex()}/{a.digest.hex()}"
    # LMCache's key (its chunk_hash is our key as an int) names the same object, and its
    # string (what a chunk header must hold) differs between the two as well.
    import torch
    from lmcache.utils import CacheEngineKey

    ka, kb = (CacheEngineKey(NS.hex(), 1, 0, k.as_int, torch.float32) for k in (a, b))
    assert object_name(ka.model_name, ka.chunk_hash) == object_name(NS, a)
    assert ka.to_string() != kb.to_string()


def test_names_refuse_what_is_not_a_key():
    import pytest

    from lmcache_mooncake.chunks.keys import chunk_name

    for ns, key in (("../etc", bytes(32)), (NS.hex()[:16], bytes(32)), (NS, b"short"), (NS, -1), (NS, 2**256)):
        with pytest.raises(ValueError):
            chunk_name(ns, key)


def test_token_major_namespaces_keep_their_digest_and_a_bad_chunk_layout_is_refused():
    """chunk_layout enters the digest only when it is "blocks": caches written before it existed
    still hit. The digest below is that of NS before the field was added."""
    import pytest

    from lmcache_mooncake.chunks.keys import namespace_for

    assert NS.hex() == "3de03f784f9be0cef40a0ad3926d4599e0f8816cd1bbdd69e94805c79e6d0b49"
    with pytest.raises(ValueError, match="chunk_layout 'pages'"):
        namespace_for("m", "float32", 1, 1, 8, 16, chunk_layout="pages")
