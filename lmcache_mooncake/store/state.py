"""What an embedded store is asked to be (:class:`StoreSpec`) and what was started (:class:`StoreState`).

The state is a JSON file (``store.json``) in the state folder; the launcher
writes it, and :func:`read_state` reads it for the launcher, the client and the
engine (``mooncake.master_address: auto``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_mooncake.store.errors import StoreError

GiB = 1 << 30
STATE_FILE = "store.json"
LOCK_FILE = "store.lock"
STATE_VERSION = 1
ENV_STATE_DIR = "LMCACHE_MOONCAKE_STORE_DIR"
LOOPBACK = "127.0.0.1"


def default_state_dir() -> Path:
    """``$LMCACHE_MOONCAKE_STORE_DIR``, else ``~/.cache/lmcache-mooncake/store``."""
    env = os.environ.get(ENV_STATE_DIR)
    if env:
        return Path(os.path.expandvars(env)).expanduser()
    return Path.home() / ".cache" / "lmcache-mooncake" / "store"


@dataclass
class StoreSpec:
    """What to start. Ports left ``None`` are picked free on 127.0.0.1."""

    #: Bytes of store memory owned by the storage process (its global segment).
    memory_bytes: int = 4 * GiB
    #: Address the master and the storage process bind and announce: 127.0.0.1
    #: (this host only), or this host's address on the network other hosts'
    #: instances reach the store through (their ``master_address``).
    host: str = LOOPBACK
    #: Master RPC port (clients' ``master_addr``).
    master_port: int | None = None
    #: Master's HTTP metadata server port (clients' ``metadata_url``). Listens on all interfaces.
    metadata_port: int | None = None
    #: Master's admin HTTP port (``/health``, ``/metrics``), bound to ``host``.
    metrics_port: int | None = None
    #: Storage process RPC port, bound to ``host`` (``shm``-mode clients attach here).
    client_port: int | None = None
    #: Folder for the state file and logs.
    state_dir: Path = field(default_factory=default_state_dir)
    #: Transfer protocol of the storage process: "tcp" or "rdma".
    protocol: str = "tcp"
    #: RDMA device names for ``protocol="rdma"`` (e.g. "mlx5_0,mlx5_1").
    rdma_devices: str = ""
    #: Threads of the storage process's RPC service (serves ``shm``-mode clients).
    client_threads: int = 4
    #: Master evicts when memory use passes this ratio (Mooncake default 0.9).
    eviction_high_watermark_ratio: float = 0.9
    #: Fraction of objects evicted per eviction round (Mooncake default 0.05).
    eviction_ratio: float = 0.05
    #: Seconds a client stays registered after its last heartbeat (Mooncake default 10).
    client_ttl_s: int = 10
    #: Seconds to wait for both processes to answer.
    wait_s: float = 30.0
    #: Extra command-line flags for the master / the storage process.
    extra_master_args: list[str] = field(default_factory=list)
    extra_client_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).expanduser()
        if self.memory_bytes < 16 << 20:
            raise StoreError(f"memory_bytes={self.memory_bytes}: give at least 16 MiB (e.g. 4 GiB)")
        if self.protocol not in ("tcp", "rdma"):
            raise StoreError(f"protocol={self.protocol!r}: use 'tcp' or 'rdma'")
        for name in ("master_port", "metadata_port", "metrics_port", "client_port"):
            port = getattr(self, name)
            if port is not None and not 0 < int(port) < 65536:
                raise StoreError(f"{name}={port} is not a TCP port (1-65535)")
        if not 0 < self.eviction_high_watermark_ratio <= 1 or not 0 < self.eviction_ratio <= 1:
            raise StoreError("eviction ratios must be in (0, 1]")
        if self.wait_s <= 0:
            raise StoreError(f"wait_s={self.wait_s} must be above 0")


@dataclass
class StoreState:
    """What :func:`start_store` started; the content of the JSON state file."""

    state_dir: Path
    host: str
    memory_bytes: int
    protocol: str
    master_port: int
    metadata_port: int
    metrics_port: int
    client_port: int
    master_pid: int
    client_pid: int
    master_cmdline: list[str]
    client_cmdline: list[str]
    master_log: str
    client_log: str
    started_at: float
    version: int = STATE_VERSION

    # Addresses clients use --------------------------------------------------
    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.master_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def client_addr(self) -> str:
        """The storage process's RPC address (``StoreClient`` ``mode="shm"`` attaches here)."""
        return f"{self.host}:{self.client_port}"

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / STATE_FILE

    def addresses(self) -> dict[str, str]:
        return {
            "master_addr": self.master_addr,
            "metadata_url": self.metadata_url,
            "client_addr": self.client_addr,
            "metrics_url": self.metrics_url,
        }

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state_dir"] = str(self.state_dir)
        d["addresses"] = self.addresses()
        d["started_at_iso"] = iso_time(self.started_at)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreState:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["state_dir"] = Path(kw["state_dir"])
        return cls(**kw)

    def write(self) -> None:
        path = self.state_file
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)


def read_state(state_dir: Path | str | None = None) -> StoreState | None:
    """The recorded state in ``state_dir`` (default :func:`default_state_dir`), or None."""
    sd = Path(state_dir).expanduser() if state_dir is not None else default_state_dir()
    path = sd / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: unreadable state file ({e}); remove it if no store runs there") from e
    try:
        return StoreState.from_dict(data)
    except (KeyError, TypeError) as e:
        raise StoreError(f"{path}: state file lacks {e}; remove it if no store runs there") from e


def iso_time(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")
