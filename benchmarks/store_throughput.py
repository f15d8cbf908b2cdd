"""Put/get throughput to an embedded Mooncake Store: our connector path vs raw Mooncake vs memcpy.

Starts its own store (``--memory-gib``, default 2 GiB, in a temporary state
folder; stopped at exit, also on an error, Ctrl-C, SIGTERM or SIGHUP), writes
most of its memory once and deletes it (Mooncake 0.3.13 does not pre-fault its
segment: the first touch of a page costs a page fault, about 1 GB/s here; a
long-running store is past that), then times, for each object size
(``--sizes``, MiB) in batches of ``--total-mib`` per call batch:

- ``connector`` (modes ``tcp`` and ``shm``): exactly what
  ``lmcache_mooncake/tiers/mooncake.py`` does. Put: per chunk
  ``chunk_format.encode(key, tensor)`` (safetensors + SHA-256 header), then one
  ``StoreClient.batch_put`` of the whole batch (which copies each blob into its
  registered staging region). Get: per chunk, one
  ``StoreClient.batch_get_into`` into a receive buffer (the tier gets one chunk
  per call), ``chunk_format.decode`` (header checks and SHA-256), and a copy
  into a destination tensor (the tier's LMCache buffer). The chunk is a real
  torch tensor ``[2, layers, tokens, hidden]`` (``--layers``, ``--hidden``,
  ``--dtype``; ``tokens`` is what makes it the object size).
- ``raw`` (modes ``tcp`` and ``shm``): ``mooncake.store.MooncakeDistributedStore``
  alone, ``batch_put_from`` / ``batch_get_into`` of the whole batch on a
  registered buffer: no copy, no check (``tcp``: ``setup`` + an anonymous
  mmap; ``shm``: ``setup_dummy`` + ``alloc_from_mem_pool``, as ``StoreClient``
  does).
- ``memcpy``: torch ``copy_`` of the same tensors into others in this process.

Each rep runs every path once, interleaved (so a drifting machine load hits
them alike), after one untimed warm-up rep; reported numbers are medians over
``--reps``. GB/s counts tensor bytes (the safetensors header, ~300 bytes per
chunk, is not counted). Every rep checks, untimed, that what was read equals
what was written. A second table splits the connector path into its stages,
and SHA-256 of the same bytes is timed alone, so it shows where the connector
loses against raw Mooncake.

    .venv/bin/python benchmarks/store_throughput.py [--sizes 1,4,16] [--total-mib 64]
        [--reps 5] [--modes tcp,shm] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import hashlib
import json
import mmap
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Loopback store: Mooncake's transfer engine must not look for a LAN address.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lmcache_mooncake.chunks import chunk_format  # noqa: E402
from lmcache_mooncake.store.client import StoreClient, describe  # noqa: E402
from lmcache_mooncake.store.launcher import StoreSpec, start_store, stop_store  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "store_throughput.json"
MiB = 1 << 20
GiB = 1 << 30
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Interrupted(BaseException):
    """SIGTERM / SIGHUP: unwind like Ctrl-C so the store is stopped."""


def _on_signal(signum: int, _frame: Any) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


# --------------------------------------------------------------------------
# Raw Mooncake clients
# --------------------------------------------------------------------------


class RawClient:
    """``MooncakeDistributedStore`` with one registered buffer of ``nbytes``: a put half and a get half."""

    def __init__(self, mode: str, state: Any, nbytes: int):
        from mooncake.store import MooncakeDistributedStore

        self.mode = mode
        self.nbytes = nbytes
        self.store = MooncakeDistributedStore()
        self._mem: Any = None
        if mode == "shm":
            rc = self.store.setup_dummy(0, 0, state.client_addr)
        else:
            rc = self.store.setup("127.0.0.1", state.metadata_url, 0, 0, "tcp", "", state.master_addr)
        if rc != 0:
            raise RuntimeError(f"raw {mode} client: Mooncake setup returned {rc}")
        if mode == "shm":
            self.ptr = int(self.store.alloc_from_mem_pool(nbytes))
            if not self.ptr:
                raise RuntimeError(f"raw shm client: alloc_from_mem_pool({nbytes}) failed")
        else:
            self._mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mem))
        rc = self.store.register_buffer(self.ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"raw {mode} client: register_buffer returned {rc}")
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))
        self.view[:] = 0  # fault the pages in once

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.unregister_buffer(self.ptr)
        with contextlib.suppress(Exception):
            self.store.close()


# --------------------------------------------------------------------------
# Timing helpers
# --------------------------------------------------------------------------


@dataclass
class Samples:
    """Seconds per rep, by name."""

    t: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.t.setdefault(name, []).append(seconds)

    def med(self, name: str) -> float:
        return statistics.median(self.t[name])


def _names(tag: str, n: int) -> tuple[list[str], list[str]]:
    """Store object names and chunk keys (as the tier builds them: the key string is in the header)."""
    u = uuid.uuid4().hex[:12]
    keys = [f"bench@1@0@{u}{i:04d}@bfloat16" for i in range(n)]
    return [f"lmcm/bench/{tag}-{u}-{i}" for i in range(n)], keys


def _check(codes: list[int], want: int | None, what: str) -> None:
    bad = [c for c in codes if (c != 0 if want is None else c != want)]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(codes)} failed, e.g. {describe(bad[0])}")


def connector_rep(
    client: StoreClient,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    recv: bytearray,
    s: Samples | None,
) -> None:
    """One batch through the tier's path (``MooncakeTierConnector._put_sync`` / ``_get_locked``)."""
    names, keys = _names(client.mode, len(src))
    t0 = time.perf_counter()
    blobs = [chunk_format.encode(k, t) for k, t in zip(keys, src, strict=True)]
    t1 = time.perf_counter()
    codes = client.batch_put(names, blobs)
    t2 = time.perf_counter()
    _check(codes, None, f"connector {client.mode} batch_put")
    blobs.clear()
    rv = memoryview(recv)
    t_get = t_dec = t_cp = 0.0
    for name, key, out in zip(names, keys, dst, strict=True):
        a = time.perf_counter()
        (n,) = client.batch_get_into([name], [rv])
        b = time.perf_counter()
        if n < 0:
            raise RuntimeError(f"connector {client.mode} batch_get_into {name}: {describe(n)}")
        tensor = chunk_format.decode(rv[:n], key)
        c = time.perf_counter()
        out.copy_(tensor)
        d = time.perf_counter()
        t_get += b - a
        t_dec += c - b
        t_cp += d - c
    for a, b in zip(src, dst, strict=True):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise RuntimeError(f"connector {client.mode}: chunk read back differs from the one written")
    for out in dst:
        out.zero_()
    if s is not None:
        s.add("put", t2 - t0)
        s.add("encode", t1 - t0)
        s.add("store_put", t2 - t1)
        s.add("get", t_get + t_dec + t_cp)
        s.add("store_get", t_get)
        s.add("decode", t_dec)
        s.add("copy_out", t_cp)


def raw_rep(raw: RawClient, src_bytes: np.ndarray, size: int, n: int, s: Samples | None) -> None:
    """One batch with ``batch_put_from`` / ``batch_get_into`` on the registered buffer."""
    total = size * n
    names, _ = _names(f"raw-{raw.mode}", n)
    put_ptrs = [raw.ptr + i * size for i in range(n)]
    get_ptrs = [raw.ptr + total + i * size for i in range(n)]
    sizes = [size] * n
    t0 = time.perf_counter()
    codes = raw.store.batch_put_from(names, put_ptrs, sizes)
    t1 = time.perf_counter()
    _check([int(c) for c in codes], None, f"raw {raw.mode} batch_put_from")
    codes = raw.store.batch_get_into(names, get_ptrs, sizes)
    t2 = time.perf_counter()
    _check([int(c) for c in codes], size, f"raw {raw.mode} batch_get_into")
    if not np.array_equal(raw.view[total : 2 * total], src_bytes):
        raise RuntimeError(f"raw {raw.mode}: bytes read back differ from the ones written")
    raw.view[total : 2 * total] = 0
    if s is not None:
        s.add("put", t1 - t0)
        s.add("get", t2 - t1)


def memcpy_rep(src: list[torch.Tensor], dst: list[torch.Tensor], s: Samples | None) -> None:
    t0 = time.perf_counter()
    for a, b in zip(src, dst, strict=True):
        b.copy_(a)
    t1 = time.perf_counter()
    if s is not None:
        s.add("copy", t1 - t0)


def sha_rep(src: list[torch.Tensor], s: Samples | None) -> None:
    views = [memoryview(t.view(torch.uint8).numpy()).cast("B") for t in src]
    t0 = time.perf_counter()
    for v in views:
        hashlib.sha256(v).hexdigest()
    t1 = time.perf_counter()
    if s is not None:
        s.add("sha256", t1 - t0)


def prefault(raw: RawClient, nbytes: int) -> float:
    """Write ``nbytes`` of objects through ``raw`` and delete them; returns seconds taken."""
    chunk = raw.nbytes // 2
    t = time.perf_counter()
    for i in range(max(nbytes // chunk, 1)):
        _check([int(raw.store.put_from(f"prefault-{i}", raw.ptr, chunk))], None, "prefault put")
    raw.store.remove_all(True)
    return time.perf_counter() - t


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


@contextlib.contextmanager
def native_stderr_to(path: Path | None):
    """Send file descriptor 2 (Mooncake's glog lines, dozens per run) to ``path``; Python keeps the terminal.

    ``None``: leave everything on the terminal (``--verbose``).
    """
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    py_stderr = sys.stderr
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        with contextlib.suppress(Exception):
            sys.stderr.close()
        sys.stderr = py_stderr


def _chunk_shape(size: int, layers: int, hidden: int, itemsize: int) -> list[int]:
    per_token = 2 * layers * hidden * itemsize
    if size % per_token:
        raise SystemExit(
            f"an object of {size} bytes is not a whole number of tokens of {per_token} bytes "
            f"(2 x {layers} layers x {hidden} x {itemsize} B); change --sizes, --layers or --hidden"
        )
    return [2, layers, size // per_token, hidden]


def _mooncake_version() -> str:
    import importlib.metadata as md

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(md.PackageNotFoundError):
            return f"{dist} {md.version(dist)}"
    return "unknown"


def run(args: argparse.Namespace, state: Any, report: dict[str, Any], opened: list[Any]) -> None:
    sizes, modes = args.size_bytes, args.mode_list
    total = args.total_mib * MiB
    dtype = _DTYPES[args.dtype]
    header_room = 64 * 1024
    max_n = max(total // s for s in sizes)
    staging = total + max_n * header_room  # one StoreClient round per batch, as the tier's 256 MiB does
    conn: dict[str, StoreClient] = {}
    raws: dict[str, RawClient] = {}
    for m in modes:
        c = StoreClient.from_state(state.state_dir, mode=m, local_buffer_bytes=staging, timeout_s=60)
        opened.append(c)
        conn[m] = c
        r = RawClient(m, state, 2 * total)
        opened.append(r)
        raws[m] = r
    admin = raws[modes[0]]

    warm = int(args.memory_gib * GiB * 0.85)
    pf_s = prefault(raws["shm"] if "shm" in raws else admin, warm)
    print(f"store warm-up: wrote and deleted {warm / GiB:.2f} GiB in {pf_s:.1f} s", flush=True)

    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []
    breakdown: list[dict[str, Any]] = []
    for size in sizes:
        n = total // size
        batch = n * size
        shape = _chunk_shape(size, args.layers, args.hidden, dtype.itemsize)
        src = [torch.randn(shape, generator=gen).to(dtype) for _ in range(n)]
        dst = [torch.zeros(shape, dtype=dtype) for _ in range(n)]
        src_bytes = np.concatenate([t.view(torch.uint8).numpy().reshape(-1) for t in src])
        for r in raws.values():
            r.view[:batch] = src_bytes
        recv = bytearray(size + header_room)  # the tier's receive buffer: a full chunk + header room
        s_conn = {m: Samples() for m in modes}
        s_raw = {m: Samples() for m in modes}
        s_mem, s_sha = Samples(), Samples()
        t_size = time.perf_counter()
        for rep in range(args.reps + 1):
            keep = rep > 0  # rep 0 warms the clients' buffers and the code paths
            for m in modes:
                connector_rep(conn[m], src, dst, recv, s_conn[m] if keep else None)
                admin.store.remove_all(True)
                raw_rep(raws[m], src_bytes[:batch], size, n, s_raw[m] if keep else None)
                admin.store.remove_all(True)
            memcpy_rep(src, dst, s_mem if keep else None)
            sha_rep(src, s_sha if keep else None)
        for d in dst:
            d.zero_()
        gb = batch / 1e9
        mem_s = s_mem.med("copy")
        mem_gbps = gb / mem_s
        label = f"{size / MiB:g} MiB"
        base = {"object_mib": size / MiB, "objects_per_batch": n, "batch_bytes": batch, "chunk_shape": shape}
        results.append(
            base
            | {
                "path": "memcpy",
                "mode": "-",
                "put_gbps": mem_gbps,
                "get_gbps": mem_gbps,
                "put_of_memcpy": 1.0,
                "get_of_memcpy": 1.0,
                "put_ms": mem_s * 1e3,
                "get_ms": mem_s * 1e3,
            }
        )
        for m in modes:
            for path, smp in (("connector", s_conn[m]), ("raw", s_raw[m])):
                put_s, get_s = smp.med("put"), smp.med("get")
                results.append(
                    base
                    | {
                        "path": path,
                        "mode": m,
                        "put_gbps": gb / put_s,
                        "get_gbps": gb / get_s,
                        "put_of_memcpy": mem_s / put_s,
                        "get_of_memcpy": mem_s / get_s,
                        "put_ms": put_s * 1e3,
                        "get_ms": get_s * 1e3,
                    }
                )
            sc = s_conn[m]
            sha_ms = s_sha.med("sha256") * 1e3
            row = base | {"mode": m, "sha256_alone_ms": sha_ms, "raw_put_ms": s_raw[m].med("put") * 1e3}
            row["raw_get_ms"] = s_raw[m].med("get") * 1e3
            for k in ("put", "encode", "store_put", "get", "store_get", "decode", "copy_out"):
                row[f"{k}_ms"] = sc.med(k) * 1e3
            # Share of the connector's time spent in chunk_format (encode / decode), and SHA-256's part.
            row["encode_share_of_put"] = row["encode_ms"] / row["put_ms"]
            row["decode_share_of_get"] = row["decode_ms"] / row["get_ms"]
            row["sha256_share_of_encode"] = sha_ms / row["encode_ms"]
            row["sha256_share_of_decode"] = sha_ms / row["decode_ms"]
            breakdown.append(row)
        print(f"{label}: {n} objects x {args.reps} reps in {time.perf_counter() - t_size:.1f} s", flush=True)
        del src, dst, src_bytes, recv
    report["results"] = results
    report["connector_breakdown"] = breakdown
    report["store_warmup_s"] = pf_s


def print_tables(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print()
    print(
        f"batches of {cfg['total_mib']} MiB, {cfg['reps']} reps (medians), chunk [2, {cfg['layers']}, T, "
        f"{cfg['hidden']}] {cfg['dtype']}; GB/s of tensor bytes; x memcpy = path GB/s / memcpy GB/s"
    )
    hdr = f"{'object':>7} {'path':<10} {'mode':<4} {'put GB/s':>9} {'get GB/s':>9} {'put x memcpy':>13} {'get x memcpy':>13}"
    print(hdr)
    print("-" * len(hdr))
    for r in report["results"]:
        print(
            f"{r['object_mib']:>3g} MiB {r['path']:<10} {r['mode']:<4} {r['put_gbps']:>9.2f} {r['get_gbps']:>9.2f} "
            f"{r['put_of_memcpy']:>12.2f}x {r['get_of_memcpy']:>12.2f}x"
        )
    print()
    print(
        f"connector path by stage, ms per {cfg['total_mib']} MiB batch (medians; raw = raw Mooncake, same batch)"
    )
    hdr = (
        f"{'object':>7} {'mode':<4} | {'put':>7} {'encode':>7} {'store':>7} {'raw':>7} | "
        f"{'get':>7} {'store':>7} {'decode':>7} {'copy':>7} {'raw':>7} | {'sha256':>7} {'chunk_format':>13}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in report["connector_breakdown"]:
        cf = (b["encode_ms"] + b["decode_ms"]) / (b["put_ms"] + b["get_ms"])
        print(
            f"{b['object_mib']:>3g} MiB {b['mode']:<4} | {b['put_ms']:>7.1f} {b['encode_ms']:>7.1f} "
            f"{b['store_put_ms']:>7.1f} {b['raw_put_ms']:>7.1f} | {b['get_ms']:>7.1f} {b['store_get_ms']:>7.1f} "
            f"{b['decode_ms']:>7.1f} {b['copy_out_ms']:>7.1f} {b['raw_get_ms']:>7.1f} | {b['sha256_alone_ms']:>7.1f} "
            f"{cf:>12.0%}"
        )
    print(
        "(encode / decode = chunk_format alone, SHA-256 included; store = StoreClient call incl. its staging "
        "copy; copy = into the destination tensor; sha256 = hashlib over the batch alone, once; chunk_format = "
        "(encode + decode) / (put + get))"
    )


def _ignore_signals(handled: dict[int, Any]) -> None:
    """From here on nothing interrupts the clean-up (a second Ctrl-C would leave the store running)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in handled:
        signal.signal(sig, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})"
    )
    parser.add_argument(
        "--sizes", default="1,4,16", help="object sizes in MiB, comma-separated (default 1,4,16)"
    )
    parser.add_argument("--total-mib", type=int, default=64, help="bytes per call batch, MiB (default 64)")
    parser.add_argument(
        "--reps", type=int, default=5, help="timed reps per size, after one warm-up (default 5)"
    )
    parser.add_argument("--modes", default="tcp,shm", help="client modes: tcp, shm or both (default tcp,shm)")
    parser.add_argument("--memory-gib", type=float, default=2.0, help="store memory, GiB (default 2)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256, help="KV heads x head size (default 256)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    parser.add_argument(
        "--verbose", action="store_true", help="leave Mooncake's own log lines on stderr (default: a file)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads; 0 = torch's choice (default 1, as benchmarks/layout_copy.py)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.total_mib < 1:
        raise SystemExit("--reps and --total-mib must be at least 1")
    # Check everything before the store starts.
    if args.total_mib * MiB > 0.8 * args.memory_gib * GiB:
        raise SystemExit(
            f"--total-mib {args.total_mib} does not fit a {args.memory_gib:g} GiB store; raise --memory-gib"
        )
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in ("tcp", "shm") for m in args.mode_list):
        raise SystemExit(f"--modes {args.modes!r}: give tcp, shm or tcp,shm")
    try:
        args.size_bytes = [int(float(x) * MiB) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sizes {args.sizes!r}: give sizes in MiB, e.g. 1,4,16") from None
    if not args.size_bytes:
        raise SystemExit("--sizes: give at least one size")
    for size in args.size_bytes:
        if not 0 < size <= args.total_mib * MiB:
            raise SystemExit(f"--sizes: {size / MiB:g} MiB must be above 0 and at most --total-mib")
        _chunk_shape(size, args.layers, args.hidden, _DTYPES[args.dtype].itemsize)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    report: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "mooncake": _mooncake_version(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "loadavg_1m_at_start": os.getloadavg()[0],
        },
    }
    old = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    opened: list[Any] = []
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="lmcm-store-bench-") as td:
            state = start_store(StoreSpec(memory_bytes=int(args.memory_gib * GiB), state_dir=Path(td)))
            native_log = None if args.verbose else Path(td) / "bench-client.log"
            try:
                print(
                    f"store: {args.memory_gib:g} GiB in {td} (master {state.master_addr}); if this process is "
                    f"killed with SIGKILL, stop it with: lmcache-mooncake store down --state-dir {td}",
                    flush=True,
                )
                with native_stderr_to(native_log):
                    try:
                        run(args, state, report, opened)
                    finally:
                        _ignore_signals(old)
                        for c in reversed(opened):
                            with contextlib.suppress(Exception):
                                c.close()
            except Exception:
                if native_log is not None and native_log.exists():
                    tail = native_log.read_text(errors="replace").splitlines()[-15:]
                    print("Mooncake client log (last lines):\n  " + "\n  ".join(tail), file=sys.stderr)
                raise
            finally:
                _ignore_signals(old)
                stop_store(td)
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"interrupted ({str(e) or 'Ctrl-C'}); the store was stopped", file=sys.stderr)
        return 130
    report["env"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    report["env"]["wall_s"] = time.perf_counter() - t_start
    print_tables(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json} ({report['env']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
