"""The cache configuration: one YAML file, loaded into a typed dataclass.

Every key is checked on load. Unknown keys, wrong types and impossible sizes
raise :class:`ConfigError`, whose message names the file and the key and says
what to do. LMCache's key names are kept where LMCache has the same setting
(``chunk_size``, ``local_cpu``, ``max_local_cpu_size``, ``local_disk``,
``max_local_disk_size``, ``save_unfull_chunk``).

Single keys may be overridden, in this order (later wins):
the YAML file, ``LMCACHE_MOONCAKE_<KEY>`` environment variables, and the
``kv_connector_extra_config`` of vLLM's ``--kv-transfer-config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from lmcache_mooncake.chunks import chunk_format

ENV_PREFIX = "LMCACHE_MOONCAKE_"


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message says where and how to fix it."""


@dataclass(frozen=True)
class MooncakeConfig:
    """The ``mooncake:`` section: the shared remote tier on a Mooncake Store.

    Translated into the arguments Mooncake's ``MooncakeDistributedStore.setup``
    really reads (``master_server_addr``, ``rdma_devices``, ...); see
    :meth:`setup_args`.
    """

    #: Master "host:port", or "auto": the store started by ``lmcache-mooncake store up``.
    master_address: str = "auto"
    #: Metadata server URL (http://host:port/metadata), or "auto" as above.
    metadata_server: str = "auto"
    #: "tcp" or "rdma".
    protocol: str = "tcp"
    #: RDMA devices, comma-separated (e.g. "mlx5_0,mlx5_1"); needed for rdma.
    rdma_devices: str = ""
    #: "auto": shared memory ("shm") with the store of this host when the
    #: addresses are auto, else "tcp". "shm" moves chunks through shared memory
    #: with the local storage process (measured faster than tcp, docs/performance.md).
    mode: str = "auto"
    #: Address this process's transfer engine binds and announces (tcp mode);
    #: default: loopback for a loopback master, else the address facing the master.
    local_hostname: str | None = None
    #: Bytes of the registered buffer chunks are staged in (int or "256MiB").
    local_buffer_size: int = 256 * 2**20
    #: Store memory this process contributes; 0 attaches without owning any,
    #: so a vLLM process that dies loses no chunk.
    global_segment_size: int = 0
    #: Seconds one store lookup or read may take; past it the call is a miss.
    timeout: float = 2.0
    #: Seconds one store write may take. Writes run off the request path, so
    #: they may wait longer; a write that fails is a future miss.
    put_timeout: float = 10.0
    #: Copies of each chunk the store keeps.
    replica_num: int = 1
    #: Protect written chunks from eviction: "none"; "soft": evicted only once
    #: no unpinned object is left, for pin_ttl seconds (Mooncake's soft pin);
    #: "hard": never evicted (until deleted or the store restarts). For warm-up
    #: of known prefixes (``warmup --pin``), not for serving traffic.
    pin: str = "none"
    #: Seconds a soft pin lasts (the master caps it, by default at 24 h).
    pin_ttl: float = 1800.0
    #: Folder where ``store up`` records the embedded store (for "auto").
    store_dir: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol: {self.protocol!r} is not one of 'tcp', 'rdma'")
        if self.mode not in ("auto", "tcp", "shm"):
            raise ConfigError(f"mode: {self.mode!r} is not one of 'auto', 'tcp', 'shm'")
        if self.mode == "shm" and self.master_address != "auto":
            raise ConfigError(
                "mode: shm attaches to the storage process started by 'lmcache-mooncake store up' on this "
                "host; it needs master_address: auto (or use mode: tcp)"
            )
        if self.protocol == "rdma" and not self.rdma_devices.strip():
            raise ConfigError("rdma_devices: protocol rdma needs devices, e.g. rdma_devices: mlx5_0")
        if self.master_address != "auto":
            host, _, port = self.master_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"master_address: {self.master_address!r} is not host:port (e.g. 127.0.0.1:50051) or auto"
                )
        if self.metadata_server != "auto" and not self.metadata_server.startswith(("http://", "P2PHANDSHAKE")):
            raise ConfigError(
                f"metadata_server: {self.metadata_server!r} must be an http:// URL "
                "(e.g. http://127.0.0.1:8080/metadata), P2PHANDSHAKE, or auto"
            )
        if self.local_buffer_size <= 0:
            raise ConfigError(f"local_buffer_size: {self.local_buffer_size} bytes is impossible; give e.g. 256MiB")
        if self.global_segment_size < 0:
            raise ConfigError(f"global_segment_size: {self.global_segment_size} is negative")
        if self.timeout <= 0:
            raise ConfigError(f"timeout: {self.timeout} must be above 0 seconds")
        if self.put_timeout <= 0:
            raise ConfigError(f"put_timeout: {self.put_timeout} must be above 0 seconds")
        if self.pin not in ("none", "soft", "hard"):
            raise ConfigError(f"pin: {self.pin!r} is not one of 'none', 'soft', 'hard'")
        if self.pin_ttl <= 0:
            raise ConfigError(f"pin_ttl: {self.pin_ttl} must be above 0 seconds")
        if self.replica_num < 1:
            raise ConfigError(f"replica_num: {self.replica_num} must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    """What one vLLM instance's connector does and where it keeps chunks."""

    #: Tokens per chunk; a chunk is the unit that is hashed, stored and loaded.
    chunk_size: int = 256
    #: Keep chunks in this process's CPU memory (LMCache's CPU tier).
    local_cpu: bool = True
    #: GiB of CPU memory for chunks. Also the staging buffer for the disk tier.
    max_local_cpu_size: float = 2.0
    #: Touch every page of that CPU memory once when the worker starts, so no
    #: load pays for first-touch page faults (RSS shows the whole pool from the start).
    prefault_cpu_tier: bool = True
    #: Folder of the persistent disk tier; null turns the disk tier off.
    local_disk: str | None = None
    #: GiB of disk the disk tier may use; the oldest chunks are evicted past it.
    max_local_disk_size: float = 8.0
    #: Also store the last, shorter-than-chunk_size piece of each prompt.
    save_unfull_chunk: bool = True
    #: Identity of the model in chunk keys; default: vLLM's served model name.
    model_id: str | None = None
    #: Read and check every disk chunk's checksum when it is first looked up,
    #: so a damaged chunk is a miss before vLLM plans to load it. False: the
    #: load reads each chunk once, straight into paged KV, and checks it there
    #: (faster; a damaged chunk's blocks are recomputed, but vLLM counts them cached).
    verify_on_lookup: bool = True
    #: What vLLM does when a planned load fails: "recompute" or "fail".
    load_failure_policy: str = "recompute"
    #: Seconds a lookup may take (the scheduler looks for the worker's answer at
    #: each of vLLM's steps meanwhile); past it the lookup is a miss.
    lookup_timeout: float = 5.0
    #: Folder for sockets and run state; default: a folder under the temp dir.
    run_dir: str | None = None
    #: Consumer: seconds to wait for chunks a producer promised (in the
    #: request's kv_transfer_params) before computing what is missing.
    load_wait_timeout: float = 5.0
    #: Load cached KV in the background (vLLM's asynchronous loading): other
    #: requests keep running while a long prompt's chunks arrive.
    async_loading: bool = True
    #: Save and load KV layer by layer as vLLM's attention layers run (save_kv_layer /
    #: wait_for_layer_load), so on a GPU the copies overlap the other layers' compute.
    #: Loads are then synchronous (async_loading is ignored). Off by default: on the
    #: CPU build it is slower (docs/performance.md); on GPUs it is unmeasured.
    layerwise: bool = False
    #: Worker: seconds between handing freed heap memory back to the OS
    #: (glibc ``malloc_trim``; see :mod:`lmcache_mooncake.runtime.heap`). ``0``: never.
    heap_trim_interval: float = 5.0
    #: Worker: blocks of this many bytes or more get their own memory mapping
    #: (glibc ``mallopt(M_MMAP_THRESHOLD)``, e.g. 262144), so they go back to the
    #: OS when freed and resident memory stays flat under load, at about 4% of
    #: prefill speed; see :mod:`lmcache_mooncake.runtime.heap`. ``0`` (default): glibc's
    #: own dynamic threshold, as plain vLLM runs.
    heap_mmap_threshold: int = 0
    #: File holding a shared secret (at least 16 bytes, e.g. ``openssl rand -hex 32``):
    #: every chunk then carries a keyed MAC (BLAKE3) instead of a bare checksum,
    #: and a chunk written without this secret, or with another, is a miss.
    #: Give every instance sharing a disk folder or store the same file.
    chunk_auth_key_file: str | None = None
    #: The shared remote tier; absent or null: CPU and disk tiers only.
    mooncake: MooncakeConfig | None = None

    def __post_init__(self) -> None:
        _check_positive_int("chunk_size", self.chunk_size)
        if self.chunk_size % 16:
            raise ConfigError(
                f"chunk_size: {self.chunk_size} is not a multiple of 16; "
                "use 256 (the default) or another multiple of vLLM's block size"
            )
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ConfigError(
                f"max_local_cpu_size: {self.max_local_cpu_size} GiB is impossible; "
                "give a size above 0 (e.g. 2) or set local_cpu: false"
            )
        if self.max_local_cpu_size < 0:
            raise ConfigError(f"max_local_cpu_size: {self.max_local_cpu_size} is negative")
        if self.local_disk is not None:
            if not self.local_disk.strip():
                raise ConfigError("local_disk: empty path; give a folder or null")
            if self.max_local_disk_size <= 0:
                raise ConfigError(
                    f"max_local_disk_size: {self.max_local_disk_size} GiB is impossible "
                    "with local_disk set; give a size above 0 or set local_disk: null"
                )
        if self.local_disk is not None and self.max_local_cpu_size <= 0:
            raise ConfigError(
                "max_local_cpu_size: the disk tier stages chunks in CPU memory; "
                "give max_local_cpu_size above 0"
            )
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(
                f"load_failure_policy: {self.load_failure_policy!r} is not one of "
                "'recompute', 'fail'"
            )
        if self.load_wait_timeout < 0:
            raise ConfigError(f"load_wait_timeout: {self.load_wait_timeout} must be 0 or more seconds")
        if not self.heap_trim_interval >= 0:
            raise ConfigError(f"heap_trim_interval: {self.heap_trim_interval} must be 0 (never) or more seconds")
        if not 0 <= self.heap_mmap_threshold <= 32 * 1024 * 1024:
            raise ConfigError(f"heap_mmap_threshold: {self.heap_mmap_threshold} must be 0 (glibc's choice) "
                              "or a size in bytes up to 33554432 (32 MiB), e.g. 262144")
        if self.lookup_timeout <= 0:
            raise ConfigError(f"lookup_timeout: {self.lookup_timeout} must be above 0 seconds")
        if self.chunk_auth_key_file is not None:
            self.seal()  # a missing or short secret fails here, at load, not in vLLM's worker

    def seal(self) -> chunk_format.Seal:
        """How this instance seals and checks chunks: a MAC with ``chunk_auth_key_file``'s
        secret, else the plain checksum. Raises :class:`ConfigError` naming the file."""
        if self.chunk_auth_key_file is None:
            return chunk_format.CHECKSUM_SEAL
        path = Path(os.path.expandvars(self.chunk_auth_key_file)).expanduser()
        try:
            secret = path.read_bytes().strip()
        except OSError as e:
            raise ConfigError(
                f"chunk_auth_key_file: cannot read {path}: {e.strerror}; create it with e.g. "
                f"'openssl rand -hex 32 > {path}' and give every instance the same file"
            ) from None
        try:
            return chunk_format.mac_seal(secret)
        except ValueError as e:
            raise ConfigError(f"chunk_auth_key_file: {path}: {e}; e.g. 'openssl rand -hex 32 > {path}'") from None

    @property
    def disk_path(self) -> Path | None:
        """The disk tier's folder, with ``~`` and environment variables expanded."""
        if self.local_disk is None:
            return None
        return Path(os.path.expandvars(self.local_disk)).expanduser().resolve()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_TOP_KEYS = {f.name for f in fields(CacheConfig)}
#: Keys whose value is a section (a mapping) and the dataclass it becomes.
_SECTIONS: dict[str, type] = {"mooncake": MooncakeConfig}
#: Keys that take sizes with units ("4GiB") as well as plain byte counts.
_SIZE_KEYS: dict[str, tuple[str, ...]] = {"MooncakeConfig": ("local_buffer_size", "global_segment_size")}


def _check_positive_int(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: {value} must be a positive integer")


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512 MiB"``, ``"1gb"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write e.g. 4GiB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _allowed_types(cls: type, name: str) -> tuple[type, ...]:
    hint = typing.get_type_hints(cls)[name]
    args = typing.get_args(hint) or (hint,)
    out: list[type] = []
    for t in args:
        out.extend((int, float) if t is float else (t,))
    return tuple(out)


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", bool: "true/false", str: "string", dict: "mapping"}
    seen = []
    for t in types:
        n = "null" if t is type(None) else names.get(t, "mapping" if dataclasses.is_dataclass(t) else t.__name__)
        if n not in seen:
            seen.append(n)
    return " or ".join(seen)


def _check_value(source: str, key: str, value: Any, cls: type = None, prefix: str = "") -> Any:  # type: ignore[assignment]
    """Return ``value`` converted to the field's type, or raise naming ``source`` and ``key``."""
    cls = cls or CacheConfig
    known = {f.name for f in fields(cls)}
    full = prefix + key
    if key not in known:
        close = difflib.get_close_matches(key, known, n=1)
        raise ConfigError(
            f"{source}: unknown key '{full}'. Known keys{' of ' + prefix[:-1] if prefix else ''}: "
            f"{', '.join(sorted(known))}" + (f" (did you mean '{prefix}{close[0]}'?)" if close else "")
        )
    types = _allowed_types(cls, key)
    section = next((t for t in types if dataclasses.is_dataclass(t)), None)
    if section is not None and isinstance(value, dict):
        # Checked key by key here; built (and its sizes checked) once every
        # source is merged, in load_config.
        return {str(k): _check_value(source, str(k), v, section, full + ".") for k, v in value.items()}
    if key in _SIZE_KEYS.get(cls.__name__, ()) and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{source}: key '{full}': {e}") from None
    # bool is an int in Python; a YAML `true` must not pass as a size.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, tuple(t for t in types if not dataclasses.is_dataclass(t)))
    if not ok:
        raise ConfigError(
            f"{source}: key '{full}' must be {_type_name(types)}, got {value!r} "
            f"({type(value).__name__})"
        )
    if float in types and isinstance(value, int):
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: key '{full}' must be a finite number, got {value!r}")
    return value


def _parse_env(key: str, raw: str) -> Any:
    value = yaml.safe_load(raw) if raw.strip() else None
    # A path or id given in the environment stays a string even if it looks numeric.
    if str in _allowed_types(CacheConfig, key) and value is not None and not isinstance(value, str):
        value = raw
    return value


def _merge(values: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheConfig:
    """Load and validate a configuration.

    ``path`` may be None for the embedded defaults. Raises :class:`ConfigError`
    naming the file (or the environment variable, or the override) and key.
    """
    values: dict[str, Any] = {}
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"{source}: cannot read the configuration file: {e.strerror}") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of keys to values, "
                f"got {type(data).__name__}"
            )
        _merge(values, {str(k): _check_value(source, str(k), v) for k, v in data.items()})

    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "MODEL_DIR":
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in _TOP_KEYS or key in _SECTIONS:
            continue  # other variables of ours (the model folder, the log level)
        values[key] = _check_value(f"environment variable {name}", key, _parse_env(key, raw))

    _merge(values, {k: _check_value("kv_connector_extra_config", k, v) for k, v in (overrides or {}).items()})

    try:
        for key, cls in _SECTIONS.items():
            if isinstance(values.get(key), dict):
                values[key] = _section(cls, key, values[key])
        return CacheConfig(**values)
    except ConfigError as e:
        where = str(path) if path is not None else "configuration"
        raise ConfigError(f"{where}: {e}") from None


def _section(cls: type, name: str, values: dict[str, Any]) -> Any:
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{name}.{e}") from None


def config_from_extra(extra: Mapping[str, Any] | None) -> CacheConfig:
    """Build the config from vLLM's ``kv_connector_extra_config``.

    ``config_file`` names the YAML file; every other key overrides one key of it.
    """
    extra = dict(extra or {})
    path = extra.pop("config_file", None)
    if path is not None and not isinstance(path, str):
        raise ConfigError(
            f"kv_connector_extra_config: 'config_file' must be a path string, got {path!r}"
        )
    return load_config(path, overrides=extra)
