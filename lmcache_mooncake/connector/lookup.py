"""Cache lookups from the scheduler process, answered by the worker process.

vLLM's scheduler (EngineCore process) must know how many prompt tokens the
tiers hold, but the tiers live in the worker process (the CPU tier is that
process's memory). The worker runs a small ZMQ REP server on a Unix socket;
the scheduler asks it with a timeout, and treats no answer as no hit.

Wire format: msgpack maps, ``{"tokens": [...], "salt": str|None,
"lora": str|None}`` -> ``{"hit": int, "runs": [[tier, end], ...]}``
(``runs`` may be absent: an older worker's reply decodes with none).

The socket is a file in a short per-user folder (:func:`lookup_socket_path`),
never in ``run_dir``: a Unix socket path has at most 107 bytes, which a deep
``TMPDIR`` or ``run_dir`` exceeds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from lmcache_mooncake import affinity

logger = logging.getLogger(__name__)

#: The longest path a Unix socket may have (``sun_path`` is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107
#: A socket file this old that refuses connections belongs to a worker that was killed.
_STALE_AFTER_S = 60.0


class LookupRequest(msgspec.Struct):
    tokens: list[int]
    salt: str | None = None
    lora: str | None = None


class LookupReply(msgspec.Struct):
    """A lookup's answer: ``hit`` prompt tokens are cached; ``runs`` says where.

    ``runs`` are ``(tier, end)`` pairs in prompt order, each covering the
    tokens from the previous run's end (or 0) to ``end``, with the tier
    (``cpu``, ``disk``, ``store``) that held them when looked up
    (:func:`lmcache_mooncake.engine.lookup_tiers`); the last ``end`` is ``hit``.
    Empty when the worker did not say (an older worker, a failed lookup).
    """

    hit: int
    runs: list[tuple[str, int]] = msgspec.field(default_factory=list)


LookupFn = Callable[[list[int], "str | None", "str | None"], LookupReply]


def _runtime_dir() -> Path:
    """A short folder only this user can enter: ``$XDG_RUNTIME_DIR/lmcache-mooncake``
    when that is short enough, else ``/tmp/lmcache-mooncake-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    # Leave room for "/lookup-<16 hex>.sock" (28 bytes).
    if xdg and os.path.isabs(xdg) and len(xdg) <= 60 and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg) / "lmcache-mooncake"
    return Path("/tmp") / f"lmcache-mooncake-{os.getuid()}"


def _private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check that it is this user's own private folder."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the folder for the connector's lookup socket {path}: {e}") from e
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} (the folder of the connector's lookup socket) must be a folder owned by this user "
            f"(uid {os.getuid()}) with mode 0700; it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}. "
            "Remove it, or set XDG_RUNTIME_DIR to a private folder of yours."
        )
    return path


def remove_stale_sockets(folder: Path) -> int:
    """Remove the lookup sockets in ``folder`` that no process listens on any more (a
    killed worker cannot remove its own); young ones are left, a server may be
    binding them right now. Returns how many were removed."""
    removed = 0
    for path in folder.glob("lookup-*.sock"):
        try:
            if time.time() - path.lstat().st_mtime < _STALE_AFTER_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(str(path))
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            removed += 1
        except OSError:  # gone meanwhile, or not ours to judge
            continue
    return removed


def lookup_socket_path(run_dir: Path, engine_id: str, dp_rank: int = 0) -> Path:
    """Where the scheduler and the worker of one engine meet: a fixed-length name
    (a hash of ``run_dir``, ``engine_id`` and ``dp_rank``) in a short private folder,
    so the path fits a Unix socket however long ``run_dir`` is. Both sides of an
    engine derive the same path; two engines (or two runs in different ``run_dir``)
    get different ones. The folder is created (0700) on first use."""
    digest = hashlib.sha256(f"{Path(run_dir).resolve()}\0{engine_id}\0{dp_rank}".encode()).hexdigest()[:16]
    path = _private_dir(_runtime_dir()) / f"lookup-{digest}.sock"
    if len(str(path).encode()) > MAX_SOCKET_PATH:  # only if /tmp itself were a long symlink target
        raise OSError(f"lookup socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
    return path


class LookupServer:
    """Answers lookups on a background thread until :meth:`close`."""

    def __init__(self, path: Path, lookup: LookupFn):
        self._path = path
        self._lookup = lookup
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_sockets(path.parent)
        path.unlink(missing_ok=True)
        self._sock.bind(f"ipc://{path}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcm-lookup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        affinity.widen_current_thread("lmcm-lookup")
        decoder = msgspec.msgpack.Decoder(LookupRequest)
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            raw = self._sock.recv()
            try:
                req = decoder.decode(raw)
                reply = self._lookup(req.tokens, req.salt, req.lora)
            except Exception:  # an answer must always be sent on a REP socket
                logger.exception("lookup failed; answering 0 (no hit)")
                reply = LookupReply(hit=0)
            self._sock.send(encoder.encode(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()
        self._path.unlink(missing_ok=True)


class LookupClient:
    """Asks the worker's :class:`LookupServer`; no answer within ``timeout`` is no hit."""

    def __init__(self, path: Path, timeout: float):
        self._addr = f"ipc://{path}"
        self._timeout_ms = int(timeout * 1000)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LookupReply)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            s.connect(self._addr)
            self._sock = s
        return self._sock

    def lookup(self, tokens: list[int], salt: str | None, lora: str | None) -> LookupReply:
        sock = self._socket()
        try:
            sock.send(self._encoder.encode(LookupRequest(tokens=list(tokens), salt=salt, lora=lora)))
            return self._decoder.decode(sock.recv())
        except zmq.Again:
            logger.warning(
                "cache lookup got no answer from the worker within %.1f s; "
                "treating it as a miss (vLLM computes the prompt)", self._timeout_ms / 1000,
            )
            # A REQ socket that missed its reply is stuck; start a fresh one.
            sock.close()
            self._sock = None
            return LookupReply(hit=0)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
