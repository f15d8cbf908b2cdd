"""Where a store client attaches, and the address helpers it needs.

- :class:`StoreEndpoint`: the master and metadata server (``tcp`` mode), or the
  storage process of this host (``shm`` mode).
- :func:`store_endpoint`: the endpoint a ``mooncake:`` section names (the
  configured addresses, or for ``auto`` the store recorded on this host).
- :func:`connect_targets` and :func:`local_hostname_for`: what
  :class:`~lmcache_mooncake.store.client.StoreClient` checks with a plain TCP
  connect before a reconnection, and the address it gives Mooncake for itself.

Nothing here imports ``mooncake``.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from lmcache_mooncake.store.errors import StoreError

if TYPE_CHECKING:
    from lmcache_mooncake.config import MooncakeConfig


@dataclass(frozen=True)
class StoreEndpoint:
    """Where a client attaches: the master and metadata server (``tcp`` mode), or the
    storage process of this host (``shm`` mode, ``client_addr``)."""

    master_addr: str
    metadata_url: str
    mode: str = "tcp"
    client_addr: str = ""


def store_endpoint(mc: MooncakeConfig) -> StoreEndpoint:
    """Where the Mooncake tier (and warm-up) attach: the configured addresses over
    TCP, or for ``auto`` the store recorded by ``lmcache-mooncake store up`` on
    this host, over shared memory unless ``mode: tcp``.

    Raises StoreError for ``auto`` while no store is recorded (the Mooncake
    tier then retries later, see ``tiers.attach``; warm-up stops)."""
    if mc.master_address != "auto" and mc.metadata_server != "auto":
        return StoreEndpoint(mc.master_address, mc.metadata_server, "tcp")
    from lmcache_mooncake.store.state import default_state_dir, read_state

    state = read_state(mc.store_dir)
    if state is None:
        where = mc.store_dir or default_state_dir()
        raise StoreError(
            f"mooncake.master_address is 'auto' but no store started by 'lmcache-mooncake store up' "
            f"is recorded in {where}. Start one with 'lmcache-mooncake store up', or set "
            "mooncake.master_address and mooncake.metadata_server to a running store."
        )
    return StoreEndpoint(
        master_addr=state.master_addr if mc.master_address == "auto" else mc.master_address,
        metadata_url=state.metadata_url if mc.metadata_server == "auto" else mc.metadata_server,
        mode="tcp" if mc.mode == "tcp" or mc.master_address != "auto" else "shm",
        client_addr=state.client_addr,
    )


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (not for other host names)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_hostport(addr: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``; StoreError if it is not one."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise StoreError(f"{addr!r} is not a host:port address")
    return host.strip("[]"), int(port)


def url_hostport(url: str) -> tuple[str, int]:
    """The ``(host, port)`` of an ``http://host:port/...`` URL; StoreError without both."""
    u = urlsplit(url)
    if not u.hostname or not u.port:
        raise StoreError(f"{url!r} is not an http://host:port/metadata URL")
    return u.hostname, u.port


def local_ip_towards(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent); 127.0.0.1 without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def connect_targets(mode: str, master_addr: str, metadata_url: str, client_addr: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` that must accept a TCP connection before a client attaches: the
    master and the metadata server (``tcp`` mode), or the storage process (``shm`` mode).
    The master comes first. StoreError for a malformed address."""
    if mode == "tcp":
        return [split_hostport(master_addr), url_hostport(metadata_url)]
    return [split_hostport(client_addr)]


def local_hostname_for(mode: str, master_host: str, configured: str | None) -> str:
    """The address a client gives Mooncake for itself: ``configured`` if set, else 127.0.0.1
    in ``shm`` mode or towards a loopback master, else this host's address towards the master."""
    if configured:
        return configured
    if mode != "tcp" or is_loopback(master_host):
        return "127.0.0.1"
    return local_ip_towards(master_host)
