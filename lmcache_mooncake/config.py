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
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "LMCACHE_MOONCAKE_"


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message says where and how to fix it."""


@dataclass(frozen=True)
class CacheConfig:
    """What one vLLM instance's connector does and where it keeps chunks."""

    #: Tokens per chunk; a chunk is the unit that is hashed, stored and loaded.
    chunk_size: int = 256
    #: Keep chunks in this process's CPU memory (LMCache's CPU tier).
    local_cpu: bool = True
    #: GiB of CPU memory for chunks. Also the staging buffer for the disk tier.
    max_local_cpu_size: float = 2.0
    #: Folder of the persistent disk tier; null turns the disk tier off.
    local_disk: str | None = None
    #: GiB of disk the disk tier may use; the oldest chunks are evicted past it.
    max_local_disk_size: float = 8.0
    #: Also store the last, shorter-than-chunk_size piece of each prompt.
    save_unfull_chunk: bool = True
    #: Identity of the model in chunk keys; default: vLLM's served model name.
    model_id: str | None = None
    #: Read and check every disk chunk's checksum when it is first looked up,
    #: so a damaged chunk is a miss before vLLM plans to load it.
    verify_on_lookup: bool = True
    #: What vLLM does when a planned load fails: "recompute" or "fail".
    load_failure_policy: str = "recompute"
    #: Seconds the scheduler waits for the worker's answer to a lookup.
    lookup_timeout: float = 5.0
    #: Folder for sockets and run state; default: a folder under the temp dir.
    run_dir: str | None = None

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
        if self.lookup_timeout <= 0:
            raise ConfigError(f"lookup_timeout: {self.lookup_timeout} must be above 0 seconds")

    @property
    def disk_path(self) -> Path | None:
        """The disk tier's folder, with ``~`` and environment variables expanded."""
        if self.local_disk is None:
            return None
        return Path(os.path.expandvars(self.local_disk)).expanduser().resolve()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_positive_int(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: {value} must be a positive integer")


_FIELDS = {f.name: f for f in fields(CacheConfig)}
_TYPES: dict[str, tuple[type, ...]] = {
    "chunk_size": (int,),
    "local_cpu": (bool,),
    "max_local_cpu_size": (int, float),
    "local_disk": (str, type(None)),
    "max_local_disk_size": (int, float),
    "save_unfull_chunk": (bool,),
    "model_id": (str, type(None)),
    "verify_on_lookup": (bool,),
    "load_failure_policy": (str,),
    "lookup_timeout": (int, float),
    "run_dir": (str, type(None)),
}
assert set(_TYPES) == set(_FIELDS), "every CacheConfig field needs a type entry"


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", bool: "true/false", str: "string"}
    return " or ".join("null" if t is type(None) else names.get(t, t.__name__) for t in types)


def _check_value(source: str, key: str, value: Any) -> Any:
    """Return ``value`` converted to the field's type, or raise naming ``source`` and ``key``."""
    if key not in _FIELDS:
        close = [k for k in _FIELDS if k.startswith(key[:4])] or sorted(_FIELDS)
        raise ConfigError(
            f"{source}: unknown key '{key}'. Known keys: {', '.join(sorted(_FIELDS))}"
            + (f" (did you mean {close[0]!r}?)" if len(close) < len(_FIELDS) else "")
        )
    types = _TYPES[key]
    # bool is an int in Python; a YAML `true` must not pass as a size.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        raise ConfigError(
            f"{source}: key '{key}' must be {_type_name(types)}, got {value!r} "
            f"({type(value).__name__})"
        )
    if float in types and isinstance(value, int):
        value = float(value)
    return value


def _parse_env(key: str, raw: str) -> Any:
    value = yaml.safe_load(raw) if raw.strip() else None
    # A path or id given in the environment stays a string even if it looks numeric.
    if str in _TYPES[key] and value is not None and not isinstance(value, str):
        value = raw
    return value


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
        for key, value in data.items():
            values[str(key)] = _check_value(source, str(key), value)

    env = os.environ if environ is None else environ
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "MODEL_DIR":
            continue
        key = name[len(ENV_PREFIX):].lower()
        if key not in _FIELDS:
            continue  # other variables of ours (e.g. the model cache folder)
        values[key] = _check_value(f"environment variable {name}", key, _parse_env(key, raw))

    for key, value in (overrides or {}).items():
        values[key] = _check_value("kv_connector_extra_config", key, value)

    try:
        return CacheConfig(**values)
    except ConfigError as e:
        where = str(path) if path is not None else "configuration"
        raise ConfigError(f"{where}: {e}") from None


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
