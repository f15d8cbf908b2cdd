"""Stored chunks: round-trip exactly; any damage is detected."""

import itertools

import pytest
import torch

from lmcache_mooncake.chunks.chunk_format import ChunkVerificationError, decode, encode


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


def test_chunk_is_a_safetensors_file():
    from safetensors.torch import load

    t = torch.randn(2, 3, 5, 8)
    assert torch.equal(load(encode("k", t))["kv"], t)


def test_decode_into_checks_the_destination_and_damage_there():
    from lmcache_mooncake.chunks.chunk_format import decode_into, encode_header, parse_header, verify

    t = torch.randn(2, 2, 6, 8)
    data = encode("k", t)
    assert data == encode_header("k", t) + t.numpy().tobytes(), "header, then the payload as it lies"
    out = torch.empty_like(t)
    decode_into(data, "k", out)
    assert torch.equal(out, t)
    with pytest.raises(ChunkVerificationError, match="destination"):
        decode_into(data, "k", torch.empty(2, 2, 5, 8))
    header = parse_header(data[: len(encode_header("k", t))], "k")  # the header alone parses
    payload = bytearray(data[header.payload_offset :])
    verify(header, payload)
    payload[7] ^= 0x10
    with pytest.raises(ChunkVerificationError, match="checksum"):
        verify(header, payload)


def test_mac_sealed_chunks_need_the_same_secret():
    import json
    import struct

    from lmcache_mooncake.chunks.chunk_format import CHECKSUM_SEAL, mac_seal

    t = torch.randn(2, 2, 6, 8)
    a, b = mac_seal(b"secret-a-" * 4), mac_seal(b"secret-b-" * 4)
    data = encode("k", t, a)
    assert torch.equal(decode(data, "k", a), t)  # the control: the same secret reads it
    assert b"xxh3_128" not in data[:4096]
    with pytest.raises(ChunkVerificationError, match="another chunk auth secret"):
        decode(data, "k", b)
    with pytest.raises(ChunkVerificationError, match="does not have"):
        decode(data, "k", CHECKSUM_SEAL)
    with pytest.raises(ChunkVerificationError, match="without the chunk auth secret"):
        decode(encode("k", t), "k", a)
    flipped = bytearray(data)
    flipped[-1] ^= 0x01
    with pytest.raises(ChunkVerificationError, match="MAC mismatch"):
        decode(bytes(flipped), "k", a)

    # A sealed payload moved under another key (header rewritten to match) fails:
    # the MAC covers the key, not only the bytes.
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    header["__metadata__"]["key"] = "other"
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    moved = struct.pack("<Q", len(blob)) + blob + data[8 + hlen :]
    with pytest.raises(ChunkVerificationError, match="MAC mismatch"):
        decode(moved, "other", a)


def test_mac_secret_must_be_long_enough():
    from lmcache_mooncake.chunks.chunk_format import mac_seal

    with pytest.raises(ValueError, match="at least 16 bytes"):
        mac_seal(b"short")


@pytest.mark.parametrize("seal", ["checksum", "mac"])
@pytest.mark.parametrize("shape", [(2, 24, 256, 128), (2, 2, 232, 128), (2, 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_header_size_is_known_before_the_bytes(seal, shape, dtype):
    """A direct get from the store splits an object into header and payload before it arrives."""
    from lmcache_mooncake.chunks.chunk_format import CHECKSUM_SEAL, encode_header, header_nbytes, mac_seal

    s = CHECKSUM_SEAL if seal == "checksum" else mac_seal(b"a-secret-of-enough-bytes")
    key = "ab" * 32 + "@1@0@" + "cd" * 32 + "@float32"
    t = torch.randn(shape).to(dtype)
    assert header_nbytes(key, dtype, shape, s) == len(encode_header(key, t, s))
    # The payload starts 8-byte aligned whatever the header holds.
    assert header_nbytes(key + "x", dtype, shape, s) % 8 == 0


@pytest.mark.parametrize("seal", ["checksum", "mac"])
def test_a_payload_hashed_in_pieces_checks_as_the_whole_does(seal):
    """What readers that scatter a payload (a disk chunk read straight into paged KV) rely on:
    the streaming hasher over pieces gives the digest the header holds, and a changed piece fails."""
    from lmcache_mooncake.chunks.chunk_format import (
        CHECKSUM_SEAL,
        check_digest,
        encode_header,
        mac_seal,
        parse_header,
        payload_hasher,
        tensor_bytes,
    )

    s = CHECKSUM_SEAL if seal == "checksum" else mac_seal(b"a-secret-of-enough-bytes")
    t = torch.randn(2, 3, 40, 16)
    header = parse_header(encode_header("k", t, s), "k", s)
    data = bytearray(tensor_bytes(t))
    cuts = [0, 1, 4096, 4100, len(data) // 2, len(data)]
    h = payload_hasher(header)
    for a, b in itertools.pairwise(cuts):
        h.update(memoryview(data)[a:b])
    check_digest(header, h.hexdigest())
    data[5000] ^= 1
    h = payload_hasher(header)
    h.update(data)
    with pytest.raises(ChunkVerificationError, match="mismatch"):
        check_digest(header, h.hexdigest())


def _rewrite_meta(data: bytes, **changes) -> bytes:
    """``data`` with its header's ``__metadata__`` changed (None deletes a field), payload kept."""
    import json
    import struct

    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    for name, value in changes.items():
        if value is None:
            header["__metadata__"].pop(name, None)
        else:
            header["__metadata__"][name] = value
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + hlen :]


def test_only_damage_under_the_readers_own_format_and_secret_is_its_to_remove():
    """Instances of other secrets or format versions share object names: what fails one
    reader's check because another wrote it is ForeignChunkError (a tier leaves it in place);
    damage under the reader's own format and seal is a plain ChunkVerificationError (removed)."""
    from lmcache_mooncake.chunks.chunk_format import CHECKSUM_SEAL, ForeignChunkError, mac_seal

    t = torch.randn(2, 2, 6, 8)
    a, b = mac_seal(b"secret-a-" * 4), mac_seal(b"secret-b-" * 4)
    assert a.key_id != b.key_id and len(a.key_id) == 32
    assert a.mac_key.hex() not in repr(a) and a.mac_key.hex()[:32] != a.key_id
    sealed_a, plain = encode("k", t, a), encode("k", t)
    assert a.key_id.encode() in sealed_a[:4096]
    assert torch.equal(decode(sealed_a, "k", a), t)  # the control: its own reader reads it

    foreign = {
        "another secret": (sealed_a, b),
        "a secret the reader lacks": (sealed_a, CHECKSUM_SEAL),
        "no secret where one is required": (plain, a),
        "another format version": (_rewrite_meta(plain, format="lmcm-chunk-9"), CHECKSUM_SEAL),
        # Written before chunks named their secret: a mismatch may be another secret's.
        "a MAC chunk naming no secret": (_rewrite_meta(sealed_a, mac_key_id=None), b),
    }
    for data, seal in foreign.values():
        with pytest.raises(ForeignChunkError):
            decode(data, "k", seal)
    assert torch.equal(decode(_rewrite_meta(sealed_a, mac_key_id=None), "k", a), t)

    def flip(data: bytes) -> bytes:
        out = bytearray(data)
        out[-1] ^= 0x01
        return bytes(out)

    damaged = {
        "payload under its own secret": (flip(sealed_a), a),
        "payload under the checksum": (flip(plain), CHECKSUM_SEAL),
        "truncated": (plain[:-3], CHECKSUM_SEAL),
        "no format field": (_rewrite_meta(plain, format=None), CHECKSUM_SEAL),
        "no seal field": (_rewrite_meta(plain, xxh3_128=None), CHECKSUM_SEAL),
        "garbage header": (b"\x10" + plain[1:], CHECKSUM_SEAL),
    }
    for why, (data, seal) in damaged.items():
        with pytest.raises(ChunkVerificationError) as caught:
            decode(data, "k", seal)
        assert not isinstance(caught.value, ForeignChunkError), why
