"""LMCache's engine with our copier, keys and disk tier, without vLLM.

Run by tests/test_engine.py, each check in a fresh process: LMCache's engine
keeps process-wide state (threads, event loops, builder registries) that other
in-process tests (vLLM's renderer, the store client) disturb, and that has
crashed a long pytest process at exit.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from pathlib import Path

import torch

from lmcache_mooncake import engine
from lmcache_mooncake.chunks import namespaces
from lmcache_mooncake.chunks.keys import KeyNamespace
from lmcache_mooncake.config import CacheConfig
from lmcache_mooncake.kv import layouts, paged_copy

L, H, D, N, B = 2, 2, 64, 16, 96
NS = KeyNamespace("m", "float32", L, H, D, 256)
_ids = itertools.count()


def make_engine(disk, cpu_gib=0.05, secret_file=None, prefault=True, ns=NS):
    cfg = CacheConfig(max_local_cpu_size=cpu_gib, local_disk=str(disk), prefault_cpu_tier=prefault,
                      chunk_auth_key_file=None if secret_file is None else str(secret_file))
    layout = layouts.layout_for_backend("CPU_ATTN")
    name = f"test-{next(_ids)}"
    return engine.build_engine(cfg, ns, layout, torch.float32, name), name


def store_and_close(disk, kv, tokens, slots, rc, secret_file=None):
    """Store ``tokens`` through an engine of its own, wait for its disk writes, close it."""
    writer, wname = make_engine(disk, secret_file=secret_file)
    writer.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
    assert engine.drain(writer, 30)
    engine.close_engine(writer, wname)


def make_kv():
    torch.manual_seed(0)
    return [torch.randn(B, H, N, 2 * D) for _ in range(L)]


def check_store_then_fresh_engine_loads_bit_exact(tmp_path, kv):
    tokens = torch.arange(600) + 100
    slots = torch.randperm(B * N)[:600]
    rc = engine.request_configs("salt", None)
    writer, wname = make_engine(tmp_path)
    try:
        writer.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
        assert engine.drain(writer, 10)
        cpu = writer.storage_manager.storage_backends["LocalCPUBackend"]
        # Nothing but the CPU tier itself holds the chunks once writes are done.
        assert [m.get_ref_count() for m in cpu.hot_cache.values()] == [1, 1, 1]
        # The disk tier recorded which fields made the namespace, beside its chunks.
        found, problems = namespaces.list_disk_manifests(tmp_path)
        assert (found, problems) == ([NS], [])
    finally:
        engine.close_engine(writer, wname)

    reader, rname = make_engine(tmp_path)
    try:
        assert reader.lookup(tokens=tokens, request_configs=rc) == 600
        assert reader.lookup(tokens=tokens, request_configs=engine.request_configs("other", None)) == 0
        out = [torch.zeros_like(t) for t in kv]
        ret = reader.retrieve(tokens, mask=None, kvcaches=out, slot_mapping=slots, request_configs=rc)
        assert bool(ret.all())
        chunk_in = torch.empty(2, L, 600, H * D)
        chunk_out = torch.empty(2, L, 600, H * D)
        paged_copy.gather_chunk(reader.gpu_connector.layout, kv, slots, chunk_in)
        paged_copy.gather_chunk(reader.gpu_connector.layout, out, slots, chunk_out)
        assert torch.equal(chunk_in, chunk_out)
    finally:
        engine.close_engine(reader, rname)


def check_damaged_file_stops_the_lookup_prefix(tmp_path, kv):
    tokens = torch.arange(600)
    slots = torch.arange(600)
    rc = engine.request_configs(None, None)
    store_and_close(tmp_path, kv, tokens, slots, rc)
    files = sorted(tmp_path.glob("*/*.lmcm"), key=lambda p: p.stat().st_size)
    assert len(files) == 3, [p.name for p in files]
    files[0].write_bytes(files[0].read_bytes()[:-10])  # the short tail chunk, truncated

    reader, rname = make_engine(tmp_path)
    try:
        assert reader.lookup(tokens=tokens, request_configs=rc) == 512
        assert not files[0].exists()
    finally:
        engine.close_engine(reader, rname)

    # A damaged full chunk stops the prefix where it is, though its neighbours are read
    # at the same time (the disk tier checks a lookup's chunks on several threads).
    seen = []
    for bad in files[1:]:
        kept = {p: p.read_bytes() for p in files[1:]}
        data = bytearray(kept[bad])
        data[-100] ^= 0xFF
        bad.write_bytes(bytes(data))
        reader, rname = make_engine(tmp_path)
        try:
            seen.append(reader.lookup(tokens=tokens, request_configs=rc))
            assert not bad.exists()
        finally:
            engine.close_engine(reader, rname)
        for p, data in kept.items():
            p.write_bytes(data)
    assert sorted(seen) == [0, 256], seen  # the first chunk damaged: nothing; the second: one chunk


def check_chunks_sealed_with_another_secret_are_misses(tmp_path, kv):
    tokens = torch.arange(600) + 7
    slots = torch.arange(600)
    rc = engine.request_configs(None, None)
    disk = tmp_path / "disk"
    secrets = {}
    for name in ("a", "b"):
        secrets[name] = tmp_path / f"secret-{name}"
        secrets[name].write_text(f"{name}-shared-secret-of-enough-bytes\n")
    store_and_close(disk, kv, tokens, slots, rc, secret_file=secrets["a"])
    files = sorted(disk.glob("*/*.lmcm"))
    assert len(files) == 3 and all(b'"blake3_mac"' in p.read_bytes()[:4096] for p in files)
    kept = {p: p.read_bytes() for p in files}

    def lookup(secret):
        for p, data in kept.items():  # a failed check removes the file: put it back
            p.write_bytes(data)
        reader, rname = make_engine(disk, secret_file=secret)
        try:
            return reader.lookup(tokens=tokens, request_configs=rc)
        finally:
            engine.close_engine(reader, rname)

    assert lookup(None) == 0  # written with a secret, read without: a miss
    assert lookup(secrets["b"]) == 0  # another secret: a miss
    assert lookup(secrets["a"]) == 600  # the control: the same secret hits


def check_lookup_names_the_tier_each_chunk_was_found_in(tmp_path, kv):
    tokens = torch.arange(600) + 11
    slots = torch.arange(600)
    rc = engine.request_configs(None, None)
    store_and_close(tmp_path, kv, tokens, slots, rc)

    reader, rname = make_engine(tmp_path)
    try:
        # The first chunk in this process's CPU tier, the rest only on disk.
        reader.store(tokens[:256], mask=None, kvcaches=kv, slot_mapping=slots[:256], request_configs=rc)
        assert engine.drain(reader, 30)
        assert engine.lookup_tiers(reader, tokens.tolist(), rc) == (600, [("cpu", 256), ("disk", 600)])
        # The disk lookup verified its chunks and kept them in the CPU tier: now all there.
        assert engine.lookup_tiers(reader, tokens.tolist(), rc) == (600, [("cpu", 600)])
        # The same hit as LMCache's own lookup; a miss names no tier.
        assert reader.lookup(tokens=tokens, request_configs=rc) == 600
        assert engine.lookup_tiers(reader, (tokens + 1).tolist(), rc) == (0, [])
    finally:
        engine.close_engine(reader, rname)


def _allocate_untouched(size: int) -> tuple[torch.Tensor, int]:
    """LMCache's CPU pool allocation without its first-touch ``fill_(0)``: as a lazy
    allocator (or another LMCache version) would leave it, mapped but not resident."""
    from lmcache.v1.platform.torch_ops import mem_alloc

    backing = torch.empty(size + mem_alloc._PAGE_SIZE, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % mem_alloc._PAGE_SIZE
    view = backing[offset : offset + size]
    return view, view.data_ptr()


def check_prefault_makes_the_cpu_pool_resident(tmp_path, kv):
    import psutil
    from lmcache.v1.platform.torch_ops import mem_alloc

    from lmcache_mooncake.runtime import prefault

    mem_alloc._alloc_page_aligned_pinned_view = _allocate_untouched
    pool_bytes = 256 << 20
    proc = psutil.Process()
    for on in (False, True):
        rss0 = proc.memory_info().rss
        eng, name = make_engine(tmp_path / str(on), cpu_gib=pool_bytes / 2**30, prefault=on)
        try:
            grown = proc.memory_info().rss - rss0
            pool = prefault.cpu_pool(eng)
            assert pool is not None and pool.numel() == pool_bytes, pool
            done = engine.context(name).prefault
            if not on:  # the control: without the touch the pool is not resident
                assert done is None
                assert grown < pool_bytes // 4, grown
                continue
            assert done.bytes == pool_bytes and done.newly_resident > 0.9 * pool_bytes, done
            assert grown > 0.9 * pool_bytes, grown
            # The touched pool still stores and loads bit-exact.
            tokens, slots = torch.arange(600) + 5, torch.randperm(B * N)[:600]
            rc = engine.request_configs(None, None)
            eng.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
            assert engine.drain(eng, 30)
            out = [torch.zeros_like(t) for t in kv]
            assert bool(eng.retrieve(tokens, mask=None, kvcaches=out, slot_mapping=slots, request_configs=rc).all())
            flat_in, flat_out = torch.empty(2, L, 600, H * D), torch.empty(2, L, 600, H * D)
            paged_copy.gather_chunk(eng.gpu_connector.layout, kv, slots, flat_in)
            paged_copy.gather_chunk(eng.gpu_connector.layout, out, slots, flat_out)
            assert torch.equal(flat_in, flat_out)
        finally:
            engine.close_engine(eng, name)


def check_blocks_chunks_load_bit_exact_from_disk(tmp_path, kv):
    """Chunks kept as the paged blocks' own bytes ("blocks" namespace): a fresh engine loads from
    disk exactly tokens [skip, end) of vLLM-shaped slots (whole blocks, a partial last chunk, a
    load that ends inside a block), and writes nothing else."""
    ns = KeyNamespace("m", "float32", L, H, D, 256, chunk_layout="blocks")
    assert layouts.layout_for_backend("CPU_ATTN").chunk_layout(kv[0], 256) == "blocks"
    tokens = torch.arange(600) + 100
    blocks = torch.randperm(B)[: -(-600 // N)]
    slots = (blocks[:, None] * N + torch.arange(N)).reshape(-1)[:600]
    rc = engine.request_configs(None, None)
    writer, wname = make_engine(tmp_path, ns=ns)
    try:
        writer.store(tokens, mask=None, kvcaches=kv, slot_mapping=slots, request_configs=rc)
        assert engine.drain(writer, 10)
    finally:
        engine.close_engine(writer, wname)
    reader, rname = make_engine(tmp_path, ns=ns)
    try:
        assert reader.gpu_connector.blocks
        assert reader.lookup(tokens=tokens, request_configs=rc) == 600
        out = [torch.zeros_like(t) for t in kv]
        skip, end = N, 599
        ret = reader.retrieve(tokens, mask=None, kvcaches=out, slot_mapping=slots[:end], request_configs=rc,
                              skip_leading_tokens=skip, load_end=end)
        assert bool(ret.all())
        want = torch.empty(2, L, 600, H * D)
        got = torch.empty(2, L, 600, H * D)
        paged_copy.gather_chunk(reader.gpu_connector.layout, kv, slots, want)
        paged_copy.gather_chunk(reader.gpu_connector.layout, out, slots, got)
        assert torch.equal(got[:, :, skip:end], want[:, :, skip:end])
        assert not got[:, :, :skip].any() and not got[:, :, end:].any()
        # Nothing outside the loaded tokens' slots was written.
        written = torch.zeros(B * N, dtype=torch.bool)
        written[slots[skip:end]] = True
        others = (~written).nonzero().squeeze(1)
        rest = torch.empty(2, L, others.numel(), H * D)
        paged_copy.gather_chunk(reader.gpu_connector.layout, out, others, rest)
        assert not rest.any()
    finally:
        engine.close_engine(reader, rname)


def check_worker_loads_disk_chunks_straight_into_paged_kv(tmp_path, kv):
    """A load whose first chunk is in the CPU tier and the rest only on disk: the first through
    LMCache's retrieve, the rest read into paged KV directly (connector.direct); tokens [skip,
    end) land bit-exact and nothing else is written. A damaged chunk on disk stops the load
    there: every block from it on is reported failed, the file is removed."""
    from lmcache_mooncake.connector import worker
    from lmcache_mooncake.connector.metadata import LoadOp

    ns = KeyNamespace("m", "float32", L, H, D, 256, chunk_layout="blocks")
    tokens = torch.arange(600) + 100
    block_ids = torch.randperm(B)[: -(-600 // N)].tolist()
    slots = [b * N + i for b in block_ids for i in range(N)][:600]
    rc = engine.request_configs(None, None)
    writer, wname = make_engine(tmp_path, ns=ns)
    try:
        writer.store(tokens, mask=None, kvcaches=kv, slot_mapping=torch.tensor(slots), request_configs=rc)
        assert engine.drain(writer, 10)
    finally:
        engine.close_engine(writer, wname)
    files = sorted(tmp_path.glob("*/*.lmcm"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) == 3

    def load(skip, end, seed):
        cfg = CacheConfig(max_local_cpu_size=0.05, local_disk=str(tmp_path), verify_on_lookup=False)
        name = f"test-{next(_ids)}"
        side = worker.WorkerSide(cfg, "m", "CPU_ATTN", N, tmp_path, tmp_path / "lookup.sock", name, 0, 1)
        out = [torch.full_like(t, float(seed)) for t in kv]
        side.kv_caches, side.namespace = out, ns
        side.engine = engine.build_engine(cfg, ns, side.layout, torch.float32, name)
        try:
            from lmcache_mooncake.connector.direct import DirectLoader
            side._direct = DirectLoader.for_engine(side.engine)
            assert side._direct is not None
            # The first chunk into the CPU tier (read and kept by a checking lookup).
            side._direct.tier.verify_on_lookup = True
            assert side.engine.lookup(tokens=tokens[:256], request_configs=rc) == 256
            side._direct.tier.verify_on_lookup = False
            chunks = list(side.engine.token_database.process_tokens(tokens, request_configs=rc))
            assert [(d, len(r)) for d, r in side._direct.segments(chunks, out)] == [("engine", 1), ("disk", 2)]
            op = LoadOp("r", tokens.tolist(), slots[:end], skip, end, block_ids)
            failed = side._load(op)
            return out, failed, side.stats.snapshot()
        finally:
            side.shutdown()

    skip, end = N, 599
    out, failed, stats = load(skip, end, 7)
    assert failed == set(), failed
    assert stats["disk_hits"] == 3 and stats["loaded_tokens"] == end - skip, stats  # 1 at the lookup
    want = torch.empty(2, L, 600, H * D)
    got = torch.empty(2, L, 600, H * D)
    layout = layouts.layout_for_backend("CPU_ATTN")
    paged_copy.gather_chunk(layout, kv, torch.tensor(slots), want)
    paged_copy.gather_chunk(layout, out, torch.tensor(slots), got)
    assert torch.equal(got[:, :, skip:end], want[:, :, skip:end])
    assert (got[:, :, :skip] == 7).all() and (got[:, :, end:] == 7).all()
    written = torch.zeros(B * N, dtype=torch.bool)
    written[torch.tensor(slots[skip:end])] = True
    others = (~written).nonzero().squeeze(1)
    rest = torch.empty(2, L, others.numel(), H * D)
    paged_copy.gather_chunk(layout, out, others, rest)
    assert (rest == 7).all()

    data = bytearray(files[1].read_bytes())
    data[-100] ^= 0xFF
    files[1].write_bytes(bytes(data))
    out, failed, stats = load(0, 599, 3)
    assert failed == set(block_ids[256 // N : -(-599 // N)]), failed
    assert stats["disk_verify_failures"] == 1 and stats["loaded_tokens"] == 256, stats
    assert not files[1].exists()


def check_layerwise_worker_saves_and_loads_like_whole_steps(tmp_path, kv):
    """``layerwise: true`` through the worker and LMCache's engine: a prompt saved layer by layer
    (save_kv_layer per layer, then wait_for_save) is read back by a fresh worker layer by layer
    (wait_for_layer_load per layer) bit for bit, and only its loaded tokens change in paged KV.
    The control: a step whose per-layer waits never came reports every planned block failed."""
    from lmcache_mooncake.connector import worker
    from lmcache_mooncake.connector.metadata import LoadOp, SaveOp, StepMetadata

    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    tokens = (torch.arange(600) + 11).tolist()
    g = torch.Generator().manual_seed(3)
    block_ids = torch.randperm(B, generator=g)[: -(-600 // N)].tolist()
    slots = [block_ids[t // N] * N + t % N for t in range(600)]
    cfg = CacheConfig(max_local_cpu_size=0.05, local_disk=str(tmp_path / "disk"), layerwise=True)

    def side(name, paged):
        run = tmp_path / name
        run.mkdir()
        s = worker.WorkerSide(cfg, "m", "CPU_ATTN", N, run, run / "lookup.sock", f"test-lw-{name}", 0, 1)
        s.register_kv_caches(dict(zip(names, paged, strict=True)))
        return s

    w = side("w", kv)
    meta = StepMetadata(saves=[SaveOp("r", tokens, slots, 0)])
    # vLLM's order in a step without a synchronous load: the forward pass (the per-layer
    # hooks), then start_load_kv, then wait_for_save.
    for name, t in zip(names, kv, strict=True):
        w.save_kv_layer(name, t, meta)
    w.start_load_kv(meta)
    w.save(meta)
    assert w.stats.snapshot().get("layerwise_saves") == 1
    w.shutdown()

    def load(with_waits):
        out = [torch.full_like(t, 7.0) for t in kv]
        before = [t.clone() for t in out]
        r = side("r" if with_waits else "r2", out)
        try:
            meta = StepMetadata(loads=[LoadOp("q", tokens, slots[:599], 40, 599, block_ids, asynchronous=False)])
            r.start_load_kv(meta)
            if with_waits:
                for name in names:
                    r.wait_for_layer_load(name)
            r.save(meta)
            return out, before, r.take_failed_blocks()
        finally:
            r.shutdown()

    out, before, failed = load(with_waits=True)
    assert failed == set(), failed
    layout = layouts.layout_for_backend("CPU_ATTN")
    loaded = torch.tensor(slots[40:599])
    others = torch.tensor(sorted(set(range(B * N)) - set(slots[40:599])))
    for name, a, b in [("loaded", kv, out), ("others", before, out)]:
        idx = loaded if name == "loaded" else others
        for i in range(L):
            want, got = torch.empty(2, len(idx), H * D), torch.empty(2, len(idx), H * D)
            layout.gather(a[i], idx, want)
            layout.gather(b[i], idx, got)
            assert torch.equal(want, got), (name, i)

    _, _, failed = load(with_waits=False)
    assert failed == set(block_ids[40 // N : -(-599 // N)]), failed


def check_tp2_ranks_store_and_load_their_own_shards(tmp_path, kv):
    """Tensor parallel 2 through the worker: each rank (half the KV heads) names its chunks in its
    own namespace, rank 0 answers lookups, and each fresh rank loads its own shard bit for bit.
    The control: with rank 1's chunks gone, rank 0's lookup still finds the prompt (it only
    knows its own), and rank 1's load reports every planned block failed (vLLM recomputes)."""
    import shutil

    from lmcache_mooncake.connector import worker
    from lmcache_mooncake.connector.metadata import LoadOp, SaveOp, StepMetadata

    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    tokens = (torch.arange(600) + 29).tolist()
    block_ids = list(range(5, 5 + -(-600 // N)))
    slots = [block_ids[t // N] * N + t % N for t in range(600)]
    cfg = CacheConfig(max_local_cpu_size=0.05, local_disk=str(tmp_path / "disk"))
    shards = [[t[:, r : r + 1].contiguous() for t in kv] for r in range(2)]  # H = 2: one head per rank

    def side(name, rank, paged):
        run = tmp_path / f"{name}-{rank}"
        run.mkdir()
        s = worker.WorkerSide(cfg, "m", "CPU_ATTN", N, run, run / "lookup.sock", f"test-tp-{name}-{rank}",
                              tp_rank=rank, tp_size=2)
        s.register_kv_caches(dict(zip(names, paged, strict=True)))
        return s

    writers = [side("w", r, shards[r]) for r in range(2)]
    assert writers[0].lookup_server is not None and writers[1].lookup_server is None
    assert writers[0].namespace != writers[1].namespace
    assert (writers[0].namespace.tp_rank, writers[1].namespace.tp_rank) == (0, 1)
    meta = StepMetadata(saves=[SaveOp("r", tokens, slots, 0)])
    for w in writers:
        w.save(meta)
        w.shutdown()
    folders = sorted(p.name for p in (tmp_path / "disk").iterdir() if p.is_dir())
    assert folders == sorted(w.namespace.hex() for w in writers), folders

    def load(rank):
        out = [torch.zeros_like(t) for t in shards[rank]]
        r = side(f"r{len(list(tmp_path.glob('r*')))}", rank, out)
        try:
            hit = r.lookup(tokens, None, None).hit if rank == 0 else None
            op = LoadOp("q", tokens, slots[:599], 0, 599, block_ids, asynchronous=False)
            r.start_load_kv(StepMetadata(loads=[op]))
            return out, r.take_failed_blocks(), hit
        finally:
            r.shutdown()

    layout = layouts.layout_for_backend("CPU_ATTN")
    idx = torch.tensor(slots[:599])
    for rank in range(2):
        out, failed, hit = load(rank)
        assert failed == set(), (rank, failed)
        assert rank or hit == 600, hit
        for i in range(L):
            want, got = torch.empty(2, 599, D), torch.empty(2, 599, D)
            layout.gather(shards[rank][i], idx, want)
            layout.gather(out[i], idx, got)
            assert torch.equal(want, got), (rank, i)

    shutil.rmtree(tmp_path / "disk" / writers[1].namespace.hex())
    _, _, hit = load(0)
    assert hit == 600, hit
    _, failed, _ = load(1)
    assert failed == set(block_ids[: -(-599 // N)]), failed


CHECKS = {
    "worker_loads_disk_chunks_straight_into_paged_kv": check_worker_loads_disk_chunks_straight_into_paged_kv,
    "blocks_chunks_load_bit_exact_from_disk": check_blocks_chunks_load_bit_exact_from_disk,
    "prefault_makes_the_cpu_pool_resident": check_prefault_makes_the_cpu_pool_resident,
    "store_then_fresh_engine_loads_bit_exact": check_store_then_fresh_engine_loads_bit_exact,
    "damaged_file_stops_the_lookup_prefix": check_damaged_file_stops_the_lookup_prefix,
    "chunks_sealed_with_another_secret_are_misses": check_chunks_sealed_with_another_secret_are_misses,
    "lookup_names_the_tier_each_chunk_was_found_in": check_lookup_names_the_tier_each_chunk_was_found_in,
    "layerwise_worker_saves_and_loads_like_whole_steps": check_layerwise_worker_saves_and_loads_like_whole_steps,
    "tp2_ranks_store_and_load_their_own_shards": check_tp2_ranks_store_and_load_their_own_shards,
}

if __name__ == "__main__":
    CHECKS[sys.argv[1]](Path(tempfile.mkdtemp(prefix="lmcm-engine-")), make_kv())
