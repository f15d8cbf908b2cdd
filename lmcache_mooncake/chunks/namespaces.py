"""Namespace manifests: which fields made a namespace digest, recorded beside its chunks.

A namespace (:class:`lmcache_mooncake.chunks.keys.KeyNamespace`) enters every file
and object name only as a SHA-256 digest, so a stored chunk does not say which
model, KV dtype or shape made it. The first time a tier writes into a
namespace it records a small manifest beside the chunks:

- disk tier: ``<local_disk>/<namespace>/namespace.json``;
- Mooncake store: the object ``lmcm/<namespace>/namespace``.

Both hold the same JSON (:func:`manifest_bytes`): the namespace's fields and
its digest. :func:`parse_manifest` reads one back and checks that the fields
hash to the digest in its name, so a damaged or forged manifest is refused,
never trusted. ``lmcache-mooncake explain`` lists manifests to tell, for a
prompt that misses, under which namespace its chunks do exist and which
fields differ (:func:`differences`).

Manifests are advisory: nothing on the serving path reads them, and a
missing one only makes ``explain`` less helpful. A store manifest can be
evicted like any object; each writer process records it again on its
first write.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from lmcache_mooncake.chunks.keys import OBJECT_PREFIX, KeyNamespace

logger = logging.getLogger(__name__)

#: Name of the disk manifest inside a namespace's folder.
DISK_MANIFEST = "namespace.json"
#: Last part of the store manifest's object name.
STORE_MANIFEST = "namespace"
#: ``format`` field of a manifest; a reader refuses other values.
MANIFEST_FORMAT = "lmcache-mooncake/namespace/v1"

#: Field -> what a person calls it, in :func:`describe`.
FIELD_LABELS = {
    "model": "model id",
    "kv_dtype": "kv dtype",
    "num_layers": "layers",
    "num_kv_heads": "kv heads",
    "head_size": "head size",
    "chunk_size": "chunk size",
    "tp_size": "tensor parallel size",
    "tp_rank": "tensor parallel rank",
    "pp_size": "pipeline parallel size",
    "pp_rank": "pipeline parallel rank",
    "chunk_layout": "chunk layout (the attention backend's blocks, or token-major)",
}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names where it came from."""


def manifest(namespace: KeyNamespace) -> dict[str, Any]:
    """The manifest of ``namespace`` as a JSON-ready dictionary."""
    return {"format": MANIFEST_FORMAT, "namespace": namespace.hex(), "fields": asdict(namespace)}


def manifest_bytes(namespace: KeyNamespace) -> bytes:
    """The manifest of ``namespace`` as stored on disk and in the store (UTF-8 JSON)."""
    return (json.dumps(manifest(namespace), indent=1, sort_keys=True) + "\n").encode()


def parse_manifest(data: bytes | str, where: str, expected_hex: str | None = None) -> KeyNamespace:
    """The namespace a manifest describes; raises :class:`ManifestError` naming ``where``.

    Checks the format, the fields (exactly :class:`KeyNamespace`'s, with their
    types; ``chunk_layout`` may be absent, as in manifests written before it)
    and that they hash to the recorded digest (and to ``expected_hex``, the
    digest in the manifest's file or object name, when given).
    """
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: not a namespace manifest (not JSON: {e})") from None
    if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{where}: not a namespace manifest of format {MANIFEST_FORMAT!r}")
    raw = obj.get("fields")
    names = {f.name: f.type for f in fields(KeyNamespace)}
    # Manifests written before chunk layouts existed have no chunk_layout: they are token-major.
    optional = {"chunk_layout"}
    if not isinstance(raw, dict) or not set(names) - optional <= set(raw) <= set(names):
        raise ManifestError(f"{where}: manifest fields are {sorted(raw) if isinstance(raw, dict) else raw!r}, "
                            f"expected {sorted(names)}")
    for name, value in raw.items():
        want = str if names[name] in ("str", str) else int
        if not isinstance(value, want) or isinstance(value, bool):
            raise ManifestError(f"{where}: manifest field {name!r} is {value!r}, expected {want.__name__}")
    ns = KeyNamespace(**raw)
    for digest in (obj.get("namespace"), expected_hex):
        if digest is not None and digest != ns.hex():
            raise ManifestError(f"{where}: manifest fields hash to {ns.hex()}, not {digest}; "
                                "the manifest is damaged or does not belong here")
    return ns


# -- where manifests live -------------------------------------------------------


def disk_manifest_path(root: Path, namespace: KeyNamespace | str) -> Path:
    """``<root>/<namespace>/namespace.json``."""
    ns = namespace.hex() if isinstance(namespace, KeyNamespace) else namespace
    return Path(root) / ns / DISK_MANIFEST


def store_manifest_name(namespace: KeyNamespace | str) -> str:
    """``lmcm/<namespace>/namespace``: the store object of a namespace's manifest."""
    ns = namespace.hex() if isinstance(namespace, KeyNamespace) else namespace
    return f"{OBJECT_PREFIX}{ns}/{STORE_MANIFEST}"


def write_disk_manifest(root: Path, namespace: KeyNamespace) -> Path:
    """Record ``namespace``'s manifest in the disk tier at ``root`` unless it is there.

    Written to a temporary file and renamed, so a reader never sees half a
    manifest. Returns the manifest's path.
    """
    path = disk_manifest_path(root, namespace)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{DISK_MANIFEST}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(manifest_bytes(namespace))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_store_manifest(client: Any, namespace: KeyNamespace, timeout_s: float | None = None) -> bool:
    """Record ``namespace``'s manifest in the store (a :class:`~lmcache_mooncake.store.client.StoreClient`).

    Mooncake keeps the first value of a key, so writers racing on one
    namespace all leave the same manifest. True if it is stored.
    """
    (code,) = client.batch_put([store_manifest_name(namespace)], [manifest_bytes(namespace)], timeout_s=timeout_s)
    return code == 0


class ManifestNotReady(Exception):
    """Raised by a tier's manifest writer that cannot write yet (no store attached): the
    recorder tries again on the tier's next write."""


class ManifestRecorder:
    """Records a tier's namespace manifest once, on the tier's first write.

    ``write`` is the tier's own way to record it (e.g. a call of
    :func:`write_disk_manifest`); an exception or a False result is logged
    and not retried, since manifests are advisory; :class:`ManifestNotReady`
    (the tier has no store yet) defers it to the next write.
    """

    def __init__(self, tier: str):
        self.tier = tier
        self._done = False
        self._lock = threading.Lock()

    def record(self, namespace: KeyNamespace | None, write: Any) -> None:
        if self._done or namespace is None:
            return
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                if write(namespace) is False:
                    raise RuntimeError("the tier refused it")
            except ManifestNotReady:
                self._done = False
            except Exception as e:  # noqa: BLE001 - advisory: never fail a chunk write for it
                logger.warning("%s: could not record the manifest of namespace %s (%s); "
                               "'lmcache-mooncake explain' will not see it", self.tier, namespace.hex(), e)


# -- listing and comparing ------------------------------------------------------


def list_disk_manifests(root: Path) -> tuple[list[KeyNamespace], list[str]]:
    """Namespaces recorded in the disk tier at ``root``, and the problems met (unreadable manifests)."""
    found: list[KeyNamespace] = []
    problems: list[str] = []
    root = Path(root)
    if not root.is_dir():
        return found, problems
    for path in sorted(root.glob(f"*/{DISK_MANIFEST}")):
        try:
            found.append(parse_manifest(path.read_bytes(), str(path), expected_hex=path.parent.name))
        except (OSError, ManifestError) as e:
            problems.append(str(e))
    return found, problems


def store_manifest_names(all_keys: list[str]) -> list[str]:
    """The manifest objects among a store's object names (as the master's ``/get_all_keys`` lists them)."""
    suffix = "/" + STORE_MANIFEST
    return sorted(k for k in all_keys if k.startswith(OBJECT_PREFIX) and k.endswith(suffix)
                  and k.count("/") == 2)


@dataclass(frozen=True)
class FieldDifference:
    """One field in which a stored namespace differs from the one asked about."""

    field: str
    stored: Any
    wanted: Any

    def describe(self) -> str:
        """E.g. ``stored with kv dtype bfloat16, this instance uses float32``."""
        label = FIELD_LABELS.get(self.field, self.field)
        return f"stored with {label} {self.stored}, this instance uses {self.wanted}"


def differences(stored: KeyNamespace, wanted: KeyNamespace) -> list[FieldDifference]:
    """The fields in which ``stored`` differs from ``wanted``, in declaration order."""
    return [FieldDifference(f.name, getattr(stored, f.name), getattr(wanted, f.name))
            for f in fields(KeyNamespace) if getattr(stored, f.name) != getattr(wanted, f.name)]
