"""Cache lookups from the scheduler process, answered by the worker process.

vLLM's scheduler (EngineCore process) must know how many prompt tokens the
tiers hold, but the tiers live in the worker process (the CPU tier is that
process's memory). The worker runs a small ZMQ REP server on a Unix socket;
the scheduler asks it with a timeout, and treats no answer as no hit.

Wire format: msgpack maps, ``{"tokens": [...], "salt": str|None,
"lora": str|None}`` -> ``{"hit": int}``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

logger = logging.getLogger(__name__)

LookupFn = Callable[[list[int], "str | None", "str | None"], int]


class LookupRequest(msgspec.Struct):
    tokens: list[int]
    salt: str | None = None
    lora: str | None = None


class LookupReply(msgspec.Struct):
    hit: int


class LookupServer:
    """Answers lookups on a background thread until :meth:`close`."""

    def __init__(self, path: Path, lookup: LookupFn):
        self._path = path
        self._lookup = lookup
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self._sock.bind(f"ipc://{path}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcm-lookup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
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
                hit = self._lookup(req.tokens, req.salt, req.lora)
            except Exception:  # an answer must always be sent on a REP socket
                logger.exception("lookup failed; answering 0 (no hit)")
                hit = 0
            self._sock.send(encoder.encode(LookupReply(hit=hit)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()
        self._path.unlink(missing_ok=True)


class LookupClient:
    """Asks the worker's :class:`LookupServer`; no answer within ``timeout`` is 0."""

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

    def lookup(self, tokens: list[int], salt: str | None, lora: str | None) -> int:
        sock = self._socket()
        try:
            sock.send(self._encoder.encode(LookupRequest(tokens=list(tokens), salt=salt, lora=lora)))
            return self._decoder.decode(sock.recv()).hit
        except zmq.Again:
            logger.warning(
                "cache lookup got no answer from the worker within %.1f s; "
                "treating it as a miss (vLLM computes the prompt)", self._timeout_ms / 1000,
            )
            # A REQ socket that missed its reply is stuck; start a fresh one.
            sock.close()
            self._sock = None
            return 0

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()
