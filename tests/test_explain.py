"""``explain``: which tier holds each chunk of a prompt, and which field differs when they are
stored under another namespace. Real disk folders and the real command line; the store's view
is faked here (the e2e test asks a real store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_mooncake.chunks import keys, namespaces
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.cli import main
from lmcache_mooncake.commands.explain import DiskView, explain
from lmcache_mooncake.kv.layouts import chunk_layout_for

REPO = Path(__file__).resolve().parent.parent
NS = KeyNamespace(model="m", kv_dtype="float32", num_layers=4, num_kv_heads=2, head_size=64, chunk_size=256)
BF16 = KeyNamespace(**{**NS.__dict__, "kv_dtype": "bfloat16"})
TOKENS = list(range(100, 700))  # 3 chunks, the last one partial


def store_chunks(root: Path, ns: KeyNamespace, tokens: list[int], salt: str | None = None,
                 count: int | None = None, manifest: bool = True) -> None:
    """Chunk files as the disk tier names them (their contents are not read by explain)."""
    for k in keys.chunk_keys(ns, tokens, salt)[:count]:
        path = root / keys.file_name(ns, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"chunk")
    if manifest:
        namespaces.write_disk_manifest(root, ns)


class FakeStore:
    """A store view holding a set of (namespace, chunk key) pairs and some manifests."""

    name, where = "store", "fake store"

    def __init__(self, held: set[tuple[str, str]], recorded: list[KeyNamespace]):
        self.held, self.recorded = held, recorded

    def holds(self, namespace, chunk_keys):
        return [(namespace.hex(), k.hex) in self.held for k in chunk_keys]

    def manifests(self):
        return self.recorded, []


def test_every_chunk_held_is_reported_per_tier(tmp_path):
    store_chunks(tmp_path, NS, TOKENS, count=2)
    last = keys.chunk_keys(NS, TOKENS)[2]
    report = explain(NS, TOKENS, None, [DiskView(tmp_path), FakeStore({(NS.hex(), last.hex)}, [])])
    assert [(c.start, c.end, c.held) for c in report.chunks] == [
        (0, 256, {"disk": True, "store": False}),
        (256, 512, {"disk": True, "store": False}),
        (512, 600, {"disk": False, "store": True}),
    ]
    assert report.held_chunks == 3 and report.elsewhere == []
    assert report.verdict.startswith("held: all 3 chunks")


def test_missing_chunks_name_the_namespace_that_holds_them_and_the_field(tmp_path):
    store_chunks(tmp_path, BF16, TOKENS)  # written at bfloat16, read at float32
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)])
    assert report.held_chunks == 0
    (other,) = report.elsewhere
    assert (other.tier, other.namespace, other.chunks_held) == ("disk", BF16.hex(), 3)
    assert [d["field"] for d in other.differences] == ["kv_dtype"]
    assert "stored with kv dtype bfloat16, this instance uses float32" in report.verdict
    assert report.to_dict()["elsewhere"][0]["summary"] == "stored with kv dtype bfloat16, this instance uses float32"


def test_the_namespace_holding_most_chunks_comes_first(tmp_path):
    other_model = KeyNamespace(**{**NS.__dict__, "model": "/models/m"})
    store_chunks(tmp_path, BF16, TOKENS, count=1)
    store_chunks(tmp_path, other_model, TOKENS)
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)])
    assert [(e.namespace, e.chunks_held) for e in report.elsewhere] == [(other_model.hex(), 3), (BF16.hex(), 1)]
    assert "stored with model id /models/m, this instance uses m" in report.verdict


def test_store_manifests_are_searched_too(tmp_path):
    first = keys.chunk_keys(BF16, TOKENS)[0]
    store = FakeStore({(BF16.hex(), first.hex)}, [BF16])
    report = explain(NS, TOKENS, None, [DiskView(tmp_path), store])
    assert [(e.tier, e.chunks_held) for e in report.elsewhere] == [("store", 1)]


def test_a_namespace_without_the_first_chunk_or_another_salt_is_no_explanation(tmp_path):
    store_chunks(tmp_path, BF16, TOKENS, salt="tenant-a")  # the same tokens, another tenant
    store_chunks(tmp_path, NS, TOKENS[:256] + [1] * 300)  # another prompt in the same namespace
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)])
    assert report.held_chunks == 1 and report.elsewhere == []
    assert "No other namespace recorded here holds its first chunk" in report.verdict
    assert "a request loads 256 of 600 tokens" in report.verdict


def test_damaged_manifest_is_a_problem_not_a_namespace(tmp_path):
    store_chunks(tmp_path, BF16, TOKENS)
    path = namespaces.disk_manifest_path(tmp_path, BF16)
    path.write_text(path.read_text().replace("bfloat16", "float16"))
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)])
    assert str(path) in report.problems[0]
    # Its chunks are still found, by trying the usual suspects, not by trusting the manifest.
    assert [(e.source, e.namespace) for e in report.elsewhere] == [("guess", BF16.hex())]


def test_partial_chunk_is_left_out_without_save_unfull_chunk(tmp_path):
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)], include_partial=False)
    assert [(c.start, c.end) for c in report.chunks] == [(0, 256), (256, 512)]


# -- the command line (vLLM's renderer for the tiny model, a disk tier, no store) ------------


def run_explain(capsys, model, disk, *args):
    rc = main(["explain", "--model", str(model), "--config", str(REPO / "configs/local.yaml"),
               "--set", f"local_disk={disk}", *args, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out.strip() else None), out.err


def test_command_finds_chunks_written_at_another_dtype(tmp_path, capsys, model):
    ids = [(7 * i) % 1900 + 16 for i in range(300)]
    # The namespace a float32 instance derives, and the same with bfloat16, from the command's own report.
    rc, f32, _ = run_explain(capsys, model, tmp_path, "--dtype", "float32", "--token-ids", json.dumps(ids))
    assert rc == 1 and f32["namespace"]["kv_dtype"] == "float32" and f32["elsewhere"] == []
    # A bfloat16 worker's chunks are token-major where vLLM picks its AMX kernel for bfloat16.
    layout = chunk_layout_for("CPU_ATTN", "bfloat16", 128, f32["namespace"]["head_size"], 256)
    bf16 = KeyNamespace(**{**f32["namespace"], "kv_dtype": "bfloat16", "chunk_layout": layout})
    store_chunks(tmp_path, bf16, ids)

    rc, again, _ = run_explain(capsys, model, tmp_path, "--dtype", "float32", "--token-ids", json.dumps(ids))
    assert rc == 1
    assert [d["field"] for d in again["elsewhere"][0]["differences"]] == (
        ["kv_dtype"] + (["chunk_layout"] if layout != f32["namespace"]["chunk_layout"] else []))
    assert "stored with kv dtype bfloat16, this instance uses float32" in again["verdict"]

    # --dtype auto is what vLLM's CPU build serves this float32 model as: bfloat16, so it is held.
    rc, auto, _ = run_explain(capsys, model, tmp_path, "--token-ids", ",".join(map(str, ids)))
    assert rc == 0 and auto["namespace_digest"] == bf16.hex() and auto["held_chunks"] == 2


def test_command_reads_a_warmup_line_and_messages(tmp_path, capsys, model):
    rc, line, _ = run_explain(capsys, model, tmp_path, "--dtype", "float32",
                              "--jsonl", str(REPO / "examples/warmup_inputs.jsonl"), "--line", "1")
    assert rc == 1 and line["prompt_tokens"] > 0
    rc, chat, _ = run_explain(capsys, model, tmp_path, "--dtype", "float32",
                              "--messages", json.dumps([{"role": "user", "content": "hi"}]), "--cache-salt", "t")
    assert rc == 1 and chat["cache_salt"] == "t" and chat["prompt_tokens"] > 0


@pytest.mark.parametrize("args, message", [
    (["--jsonl", "examples/warmup_inputs.jsonl"], "--jsonl needs --line"),
    (["--jsonl", "examples/warmup_inputs.jsonl", "--line", "999"], "there is no line 999"),
    (["--token-ids", "1,x"], "give integers"),
    (["--token-ids", "[99999999]"], "outside the model's vocabulary"),
    (["--messages", "{not json"], "--messages is not JSON"),
    (["--prompt", "hi", "--tensor-parallel-size", "2", "--tp-rank", "2"], "--tp-rank 2 is not in"),
])
def test_command_errors_say_what_to_do(tmp_path, capsys, model, args, message, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, out, err = run_explain(capsys, model, tmp_path, *args)
    assert rc == 2 and out is None and message in err


# -- the store view: manifests listed through the master's admin HTTP server ---------------


class _Admin:
    """The master's /get_all_keys (one name a line), served on loopback."""

    def __init__(self, names: list[str]):
        import http.server
        import threading

        body = "\n".join(names).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server API
                code = 200 if self.path == "/get_all_keys" else 404
                self.send_response(code)
                self.end_headers()
                self.wfile.write(body if code == 200 else b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class _Client:
    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects

    def batch_exists(self, names):
        return [n in self.objects for n in names]

    def batch_get_into(self, names, buffers):
        codes = []
        for n, b in zip(names, buffers, strict=True):
            data = self.objects.get(n)
            if data is None:
                codes.append(-704)
            else:
                b[: len(data)] = data
                codes.append(len(data))
        return codes


def test_store_view_reads_the_manifests_the_master_lists():
    from lmcache_mooncake.commands.explain import StoreView

    first = keys.chunk_keys(BF16, TOKENS)[0]
    damaged = KeyNamespace(**{**NS.__dict__, "chunk_size": 512})
    objects = {
        namespaces.store_manifest_name(BF16): namespaces.manifest_bytes(BF16),
        keys.object_name(BF16, first): b"chunk",
        namespaces.store_manifest_name(damaged): b"{}",
    }
    admin = _Admin([*objects, namespaces.store_manifest_name(NS)])  # listed, then evicted: unreadable
    try:
        view = StoreView(_Client(objects), admin.url, "test store")
        found, problems = view.manifests()
        assert found == [BF16]
        assert len(problems) == 2 and all("store object lmcm/" in p for p in problems)
        report = explain(NS, TOKENS, None, [view])
        assert [(e.tier, e.chunks_held) for e in report.elsewhere] == [("store", 1)]
    finally:
        admin.server.shutdown()


def test_store_view_without_the_admin_server_says_how_to_give_it():
    from lmcache_mooncake.commands.explain import StoreView

    found, problems = StoreView(_Client({}), "http://127.0.0.1:9", "test store").manifests()
    assert found == [] and "--master-http" in problems[0]
    assert "--master-http" in StoreView(_Client({}), None, "test store").manifests()[1][0]


def test_without_a_manifest_the_usual_suspects_are_tried(tmp_path):
    store_chunks(tmp_path, BF16, TOKENS, manifest=False)  # written before manifests existed
    report = explain(NS, TOKENS, None, [DiskView(tmp_path)])
    (other,) = report.elsewhere
    assert (other.source, other.namespace, other.chunks_held) == ("guess", BF16.hex(), 3)
    assert "no manifest records it" in report.verdict
    assert "stored with kv dtype bfloat16, this instance uses float32" in report.verdict
