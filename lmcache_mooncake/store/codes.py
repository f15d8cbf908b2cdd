"""Return codes of :class:`lmcache_mooncake.store.client.StoreClient` calls.

Mooncake's own codes are passed through (negative, small); the client adds
its own (``ERR_*``, below -10000). :func:`describe` names any of them.
"""

from __future__ import annotations

#: Success.
OK = 0
#: Mooncake OBJECT_NOT_FOUND: the key is not in the store.
NOT_FOUND = -704
#: Mooncake INVALID_PARAMS (e.g. destination buffer smaller than the object).
INVALID_PARAMS = -600
#: Mooncake RPC_FAIL / RPC_TIMEOUT: the master or a peer could not be reached.
RPC_FAIL = -900
RPC_TIMEOUT = -901

#: The call did not finish within ``timeout_s``; it was abandoned (it may still complete).
ERR_TIMEOUT = -10001
#: The client is unhealthy (waiting to reconnect) or its worker is still busy with an abandoned call.
ERR_UNAVAILABLE = -10002
#: The object is larger than the staging region (``local_buffer_bytes``).
ERR_TOO_LARGE = -10003
#: The buffer is unusable: unsupported type, not contiguous, or read-only for a get.
ERR_BAD_BUFFER = -10004
#: The client was closed.
ERR_CLOSED = -10005
#: The Mooncake binding raised an exception (logged).
ERR_INTERNAL = -10006

_NAMES = {
    0: "OK",
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (store full)",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    ERR_TIMEOUT: "CLIENT_TIMEOUT",
    ERR_UNAVAILABLE: "CLIENT_UNAVAILABLE",
    ERR_TOO_LARGE: "TOO_LARGE_FOR_STAGING",
    ERR_BAD_BUFFER: "BAD_BUFFER",
    ERR_CLOSED: "CLIENT_CLOSED",
    ERR_INTERNAL: "BINDING_ERROR",
}

#: Codes after which the client considers the master (or storage process) unreachable.
_CONNECTION_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT, -103})


def describe(code: int) -> str:
    """A readable name for a return code (``'OBJECT_NOT_FOUND (-704)'``)."""
    if code > 0:
        return f"{code} bytes"
    return f"{_NAMES.get(code, 'ERROR')} ({code})"
