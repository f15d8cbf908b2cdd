"""Namespace manifests: written once, read back only when they hash to their name, and compared."""

import json
import logging

import pytest

from lmcache_mooncake.chunks import namespaces
from lmcache_mooncake.chunks.keys import KeyNamespace, object_name

NS = KeyNamespace(model="m", kv_dtype="float32", num_layers=4, num_kv_heads=2, head_size=64, chunk_size=256)
BF16 = KeyNamespace(**{**NS.__dict__, "kv_dtype": "bfloat16"})


def test_manifest_round_trips_and_names_its_digest():
    data = namespaces.manifest_bytes(NS)
    assert json.loads(data)["namespace"] == NS.hex()
    assert namespaces.parse_manifest(data, "x", expected_hex=NS.hex()) == NS


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["fields"].update(kv_dtype="bfloat16"), "hash to"),
    (lambda m: m["fields"].pop("chunk_size"), "manifest fields"),
    (lambda m: m["fields"].update(num_layers="4"), "expected int"),
    (lambda m: m.update(format="other/v9"), "format"),
])
def test_damaged_manifest_is_refused_naming_where(edit, message):
    m = namespaces.manifest(NS)
    edit(m)
    with pytest.raises(namespaces.ManifestError, match=message) as e:
        namespaces.parse_manifest(json.dumps(m), "/kv/abc/namespace.json")
    assert "/kv/abc/namespace.json" in str(e.value)


def test_manifest_under_another_digest_is_refused():
    with pytest.raises(namespaces.ManifestError, match="does not belong here"):
        namespaces.parse_manifest(namespaces.manifest_bytes(NS), "x", expected_hex=BF16.hex())


def test_not_json_is_refused():
    with pytest.raises(namespaces.ManifestError, match="not JSON"):
        namespaces.parse_manifest(b"\xff\x00", "x")


def test_disk_manifests_are_listed_with_their_problems(tmp_path):
    namespaces.write_disk_manifest(tmp_path, NS)
    namespaces.write_disk_manifest(tmp_path, BF16)
    first = namespaces.disk_manifest_path(tmp_path, NS).read_bytes()
    namespaces.write_disk_manifest(tmp_path, NS)  # already there: left as it is
    assert namespaces.disk_manifest_path(tmp_path, NS).read_bytes() == first
    # A manifest copied into the wrong namespace's folder is a problem, not a namespace.
    wrong = tmp_path / ("0" * 64) / namespaces.DISK_MANIFEST
    wrong.parent.mkdir()
    wrong.write_bytes(first)
    found, problems = namespaces.list_disk_manifests(tmp_path)
    assert sorted(found, key=KeyNamespace.hex) == sorted([NS, BF16], key=KeyNamespace.hex)
    assert len(problems) == 1 and str(wrong) in problems[0]
    assert not list(tmp_path.rglob("*.tmp"))
    assert namespaces.list_disk_manifests(tmp_path / "absent") == ([], [])


def test_store_manifest_names_are_picked_out_of_all_keys():
    chunk = object_name(NS, bytes(32))
    manifest = namespaces.store_manifest_name(NS)
    assert manifest == f"lmcm/{NS.hex()}/namespace"
    assert namespaces.store_manifest_names([chunk, manifest, "other/x/namespace", "lmcm/a/b/namespace"]) == [manifest]


def test_differences_name_the_field_as_a_person_would():
    (diff,) = namespaces.differences(BF16, NS)
    assert diff.field == "kv_dtype"
    assert diff.describe() == "stored with kv dtype bfloat16, this instance uses float32"
    assert namespaces.differences(NS, NS) == []
    other = KeyNamespace(**{**NS.__dict__, "model": "/models/a", "tp_size": 2, "tp_rank": 1})
    assert [d.field for d in namespaces.differences(other, NS)] == ["model", "tp_size", "tp_rank"]


class _Client:
    def __init__(self, code):
        self.code, self.puts = code, []

    def batch_put(self, names, buffers, timeout_s=None):
        self.puts.append((names, [bytes(b) for b in buffers]))
        return [self.code]


def test_recorder_writes_once_and_survives_a_failing_tier(caplog, monkeypatch):
    # logs.setup_logging (run by any earlier test that built a connector) stops propagation.
    monkeypatch.setattr(logging.getLogger("lmcache_mooncake"), "propagate", True)
    client = _Client(0)
    rec = namespaces.ManifestRecorder("lmcm_mooncake")
    for _ in range(3):
        rec.record(NS, lambda ns: namespaces.write_store_manifest(client, ns))
    assert client.puts == [([namespaces.store_manifest_name(NS)], [namespaces.manifest_bytes(NS)])]

    refused = namespaces.ManifestRecorder("lmcm_mooncake")
    refused.record(NS, lambda ns: namespaces.write_store_manifest(_Client(-600), ns))
    assert "could not record the manifest" in caplog.text

    def broken(ns):
        raise OSError("disk full")

    namespaces.ManifestRecorder("lmcm_disk").record(NS, broken)
    assert "disk full" in caplog.text


def test_recorder_defers_while_the_tier_is_not_ready():
    calls = []

    def not_yet(ns):
        calls.append(ns)
        if len(calls) == 1:
            raise namespaces.ManifestNotReady
        return True

    rec = namespaces.ManifestRecorder("lmcm_mooncake")
    for _ in range(3):
        rec.record(NS, not_yet)
    assert len(calls) == 2  # deferred once, then written once


def test_a_manifest_from_before_chunk_layouts_reads_as_token_major():
    m = namespaces.manifest(NS)
    del m["fields"]["chunk_layout"]
    assert namespaces.parse_manifest(json.dumps(m), "x", expected_hex=NS.hex()) == NS
    blocks = KeyNamespace(**{**NS.__dict__, "chunk_layout": "blocks"})
    assert namespaces.parse_manifest(namespaces.manifest_bytes(blocks), "x") == blocks
    (diff,) = namespaces.differences(blocks, NS)
    assert diff.field == "chunk_layout" and "token-major" in diff.describe()
