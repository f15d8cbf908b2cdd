"""The settings of one :class:`~lmcache_mooncake.store.client.StoreClient`, checked once.

:class:`ClientSettings` holds the constructor arguments of the client (the
keyword arguments of :meth:`StoreClient.connect` other than those of the
connection attempt itself). Building one checks every value and raises
:class:`~lmcache_mooncake.store.errors.StoreError` saying which one is wrong
and what to give instead; a few values are normalised (numbers to ``int`` or
``float``, ``max_retry_interval_s`` at least ``retry_interval_s``,
``rebuild_after`` at least 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_mooncake.store.errors import StoreError

MiB = 1 << 20

#: Values of ``pin`` (``mooncake.pin`` in the YAML).
PINS = ("none", "soft", "hard")


@dataclass(frozen=True)
class ClientSettings:
    """How a client attaches and behaves. Immutable; see the fields for their meaning."""

    #: ``tcp`` mode: the master ("host:port") and metadata server ("http://host:port/metadata").
    master_addr: str = ""
    metadata_url: str = ""
    #: "tcp" (the regular Mooncake client, any host) or "shm" (same host as the store).
    mode: str = "tcp"
    #: ``shm`` mode: the storage process's RPC address ("host:port").
    client_addr: str = ""
    #: ``tcp`` mode: Mooncake's transfer protocol, "tcp" or "rdma", and the RDMA devices.
    protocol: str = "tcp"
    rdma_devices: str = ""
    #: The registered staging region: the most bytes one Mooncake call moves.
    local_buffer_bytes: int = 256 * MiB
    #: The limit of every call, in seconds.
    timeout_s: float = 2.0
    #: Store memory this client contributes (0: none, the storage process keeps the objects).
    global_segment_bytes: int = 0
    #: The address given to Mooncake for this client (default: see ``endpoint.local_hostname_for``).
    local_hostname: str | None = None
    #: Back-off between reconnection attempts: doubles from the first up to the second.
    retry_interval_s: float = 1.0
    max_retry_interval_s: float = 10.0
    #: Failed probes after which a new Mooncake client is built (``tcp`` mode).
    rebuild_after: int = 3
    #: Copies of each object the store keeps.
    replica_num: int = 1
    #: How puts protect their objects from eviction: "none", "soft" (evicted only after
    #: every unpinned object, for ``pin_ttl_s``) or "hard" (never).
    pin: str = "none"
    pin_ttl_s: float = 1800.0

    def __post_init__(self) -> None:
        mode = self.mode
        if mode not in ("tcp", "shm"):
            raise StoreError(f"mode={mode!r}: use 'tcp' (any host) or 'shm' (same host as the store)")
        if mode == "tcp" and (not self.master_addr or not self.metadata_url):
            raise StoreError("mode='tcp' needs master_addr and metadata_url")
        if mode == "shm" and not self.client_addr:
            raise StoreError("mode='shm' needs client_addr (the storage process's host:port)")
        if self.protocol not in ("tcp", "rdma"):
            raise StoreError(f"protocol={self.protocol!r}: use 'tcp' or 'rdma'")
        if self.timeout_s <= 0:
            raise StoreError(f"timeout_s={self.timeout_s} must be above 0")
        if self.local_buffer_bytes < MiB:
            raise StoreError(f"local_buffer_bytes={self.local_buffer_bytes}: give at least 1 MiB")
        if self.replica_num < 1:
            raise StoreError(f"replica_num={self.replica_num} must be at least 1")
        if self.pin not in PINS:
            raise StoreError(f"pin={self.pin!r}: use one of {', '.join(PINS)}")
        if self.pin_ttl_s <= 0:
            raise StoreError(f"pin_ttl_s={self.pin_ttl_s} must be above 0")
        normalised = {
            "local_buffer_bytes": int(self.local_buffer_bytes),
            "timeout_s": float(self.timeout_s),
            "global_segment_bytes": int(self.global_segment_bytes),
            "retry_interval_s": float(self.retry_interval_s),
            "max_retry_interval_s": float(max(self.max_retry_interval_s, self.retry_interval_s)),
            "rebuild_after": max(int(self.rebuild_after), 1),
            "replica_num": int(self.replica_num),
            "pin_ttl_s": float(self.pin_ttl_s),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)
