"""Stored chunks: round-trip exactly; any damage is detected."""

import pytest
import torch

from lmcache_mooncake.chunk_format import ChunkVerificationError, decode, encode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(dtype):
    t = torch.randn(2, 3, 17, 8).to(dtype)
    out = decode(encode("key-1", t), "key-1")
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


def test_damage_wrong_key_and_truncation_are_detected():
    t = torch.randn(2, 2, 4, 8)
    data = bytearray(encode("k", t))
    with pytest.raises(ChunkVerificationError, match="key"):
        decode(bytes(data), "other")
    flipped = bytearray(data)
    flipped[-5] ^= 0x01
    with pytest.raises(ChunkVerificationError, match="checksum"):
        decode(bytes(flipped), "k")
    with pytest.raises(ChunkVerificationError):
        decode(bytes(data[:-3]), "k")
    with pytest.raises(ChunkVerificationError):
        decode(b"\x00" * 4, "k")
    with pytest.raises(ChunkVerificationError):
        decode(b"garbage-garbage-garbage", "k")
