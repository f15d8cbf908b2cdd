"""Cache lookups from the scheduler process, answered by the worker process.

vLLM's scheduler (EngineCore process) must know how many prompt tokens the
tiers hold, but the tiers live in the worker process (the CPU tier is that
process's memory). The worker runs a small ZMQ ROUTER server on a Unix
socket and answers on two threads; the scheduler asks through a DEALER
without waiting for the answer (:meth:`LookupClient.ask`: it looks for it
at each of vLLM's steps), and treats no answer within ``lookup_timeout`` as
no hit. So a long prompt's disk lookup does not stop vLLM's scheduler.

Wire format: msgpack maps, ``{"tokens": [...], "salt": str|None,
"lora": str|None, "id": int}`` -> ``{"hit": int, "runs": [[tier, end], ...],
"id": int}`` (the question's number echoed; ``runs`` may be absent: an older
worker's reply decodes with none).

The socket is a file in a short per-user folder (:func:`lookup_socket_path`),
never in ``run_dir``: a Unix socket path has at most 107 bytes, which a deep
``TMPDIR`` or ``run_dir`` exceeds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import stat
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import zmq

from lmcache_mooncake.runtime import affinity

logger = logging.getLogger(__name__)

#: The longest path a Unix socket may have (``sun_path`` is 108 bytes, NUL included).
MAX_SOCKET_PATH = 107
#: A socket file this old that refuses connections belongs to a worker that was killed.
_STALE_AFTER_S = 60.0


class LookupRequest(msgspec.Struct):
    tokens: list[int]
    salt: str | None = None
    lora: str | None = None
    #: The client's number for this question, echoed in the reply.
    id: int = 0


class LookupReply(msgspec.Struct):
    """A lookup's answer: ``hit`` prompt tokens are cached; ``runs`` says where.

    ``runs`` are ``(tier, end)`` pairs in prompt order, each covering the
    tokens from the previous run's end (or 0) to ``end``, with the tier
    (``cpu``, ``disk``, ``store``) that held them when looked up
    (:func:`lmcache_mooncake.engine.lookup_tiers`); the last ``end`` is ``hit``.
    Empty when the worker did not say (an older worker, a failed lookup).
    ``id`` is the question's (:attr:`LookupRequest.id`).
    """

    hit: int
    runs: list[tuple[str, int]] = msgspec.field(default_factory=list)
    id: int = 0


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
    """Answers lookups until :meth:`close`: a thread receives the questions and sends
    the answers; ``threads`` workers answer them, so a quick question (a miss, a
    prompt in the CPU tier) is not queued behind a long prompt's disk reads."""

    def __init__(self, path: Path, lookup: LookupFn, threads: int = 2):
        self._path = path
        self._lookup = lookup
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_sockets(path.parent)
        path.unlink(missing_ok=True)
        self._sock.bind(f"ipc://{path}")
        self._stop = threading.Event()
        # Answers the workers made, for the socket's own thread to send (zmq sockets are
        # not thread-safe); a byte on the pipe wakes that thread.
        self._answers: queue.SimpleQueue[tuple[bytes, LookupReply]] = queue.SimpleQueue()
        self._decoder = msgspec.msgpack.Decoder(LookupRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._wake_r, self._wake_w = os.pipe()
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="lmcm-lookup",
                                        initializer=affinity.widen_current_thread, initargs=("lmcm-lookup",))
        self._thread = threading.Thread(target=self._run, name="lmcm-lookup", daemon=True)
        self._thread.start()

    def _answer(self, identity: bytes, req: LookupRequest) -> None:
        """On a worker: answer one question (always: a client waits for it)."""
        try:
            reply = self._lookup(req.tokens, req.salt, req.lora)
        except Exception:
            logger.exception("lookup failed; answering 0 (no hit)")
            reply = LookupReply(hit=0)
        self._answers.put((identity, msgspec.structs.replace(reply, id=req.id)))
        os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        affinity.widen_current_thread("lmcm-lookup")
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            while True:
                try:
                    identity, reply = self._answers.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart([identity, self._encoder.encode(reply)])
            if self._sock in ready:
                while True:
                    try:
                        identity, raw = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not [identity, question]: not one of our clients
                        continue
                    try:
                        req = self._decoder.decode(raw)
                    except msgspec.DecodeError:
                        logger.warning("cache lookup: a question that does not decode; ignored")
                        continue
                    self._pool.submit(self._answer, identity, req)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        # Queued questions are dropped; running ones end first: they use the engine the
        # worker closes next, and write to the wake pipe closed below (its number could
        # otherwise be reused by another file meanwhile).
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sock.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._path.unlink(missing_ok=True)


class LookupClient:
    """Asks the worker's :class:`LookupServer`; no answer within ``timeout`` is no hit.

    Called by the scheduler side only (vLLM's EngineCore thread). Questions are
    open until answered: :meth:`ask` sends one (or finds it open) and waits at most
    ``wait`` seconds for the answer, so vLLM's loop, which cannot schedule anything
    while the scheduler waits, takes in new requests between waits."""

    def __init__(self, path: Path, timeout: float):
        self._addr = f"ipc://{path}"
        self._timeout = timeout
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LookupReply)
        self._next_id = 1
        #: Open questions: caller's key -> (question id, when sent).
        self._open: dict[Hashable, tuple[int, float]] = {}
        #: Answers received for open questions, by question id.
        self._answers: dict[int, LookupReply] = {}

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, int(self._timeout * 1000))
            s.connect(self._addr)
            self._sock = s
        return self._sock

    def ask(self, key: Hashable, tokens: list[int], salt: str | None, lora: str | None,
            wait: float) -> LookupReply | None:
        """The answer to the lookup of ``tokens`` asked under ``key``, or None if it has not
        come within ``wait`` seconds (the question stays open: ask again with the same
        ``key``). The first call for ``key`` sends the question. A question open longer
        than ``timeout`` (or one that cannot be sent) is answered ``hit=0``, with a warning."""
        opened = self._open.get(key)
        if opened is None:
            qid, self._next_id = self._next_id, self._next_id + 1
            try:
                self._socket().send(self._encoder.encode(LookupRequest(tokens=list(tokens), salt=salt, lora=lora,
                                                                        id=qid)))
            except zmq.Again:
                return self._timed_out(key)
            opened = self._open[key] = (qid, time.monotonic())
        qid, sent = opened
        deadline = min(time.monotonic() + max(wait, 0.0), sent + self._timeout)
        while qid not in self._answers:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket().poll(int(left * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= sent + self._timeout:
                    return self._timed_out(key)
                return None
            self._receive()
        del self._open[key]
        return self._answers.pop(qid)

    def _receive(self) -> None:
        """Take every answer that has arrived; drop those to questions no longer open."""
        open_ids = {qid for qid, _ in self._open.values()}
        while True:
            try:
                raw = self._socket().recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self._decoder.decode(raw)
            except msgspec.DecodeError:
                logger.warning("cache lookup: an answer from the worker could not be decoded; ignored")
                continue
            if reply.id in open_ids:
                self._answers[reply.id] = reply

    def _timed_out(self, key: Hashable) -> LookupReply:
        logger.warning(
            "cache lookup got no answer from the worker within %.1f s; "
            "treating it as a miss (vLLM computes the prompt)", self._timeout,
        )
        self.cancel(key)
        return LookupReply(hit=0)

    def is_open(self, key: Hashable) -> bool:
        """Whether a question asked under ``key`` waits for its answer."""
        return key in self._open

    def cancel(self, key: Hashable) -> None:
        """Forget the question asked under ``key`` (its request ended); a late answer is dropped."""
        opened = self._open.pop(key, None)
        if opened is not None:
            self._answers.pop(opened[0], None)

    def lookup(self, tokens: list[int], salt: str | None, lora: str | None) -> LookupReply:
        """Ask and wait for the answer (up to ``timeout``)."""
        key = object()
        reply = self.ask(key, tokens, salt, lora, wait=self._timeout)
        return reply if reply is not None else self._timed_out(key)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
