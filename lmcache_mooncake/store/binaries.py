"""The Mooncake store's executables in this Python environment, and what they need to run."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from lmcache_mooncake.store.errors import StoreError

# Shared libraries the Mooncake binaries load, and the Debian/Ubuntu package
# that provides each (the loader error names the library, not the package).
_LIB_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
}
_LOADER_ERROR = re.compile(r"error while loading shared libraries: (\S+?): cannot open shared object file")



def find_binaries() -> tuple[Path, Path]:
    """The ``mooncake_master`` and ``mooncake_client`` executables of the installed wheel.

    The ELF binaries inside the ``mooncake`` package folder are preferred to the
    console-script wrappers so that the recorded pid and command line are the
    server's own.
    """
    import importlib.util

    found: dict[str, Path] = {}
    spec = importlib.util.find_spec("mooncake")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for name in ("mooncake_master", "mooncake_client"):
        for folder in folders:
            p = Path(folder) / name
            if p.is_file():
                if not os.access(p, os.X_OK):
                    with contextlib.suppress(OSError):
                        p.chmod(p.stat().st_mode | 0o111)
                found[name] = p
                break
        else:
            w = shutil.which(name)
            if w:
                found[name] = Path(w)
    missing = [n for n in ("mooncake_master", "mooncake_client") if n not in found]
    if missing:
        raise StoreError(
            f"{' and '.join(missing)} not found: install Mooncake into this Python environment "
            "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1, or "
            "mooncake-transfer-engine==0.3.13.post1 on CUDA hosts)"
        )
    return found["mooncake_master"], found["mooncake_client"]


def missing_library_hint(text: str) -> str | None:
    """An install hint when ``text`` contains a dynamic-loader 'cannot open shared object' error."""
    m = _LOADER_ERROR.search(text) or re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object", text)
    if not m:
        return None
    lib = m.group(1)
    pkg = _LIB_PACKAGES.get(lib)
    if pkg:
        return f"shared library {lib} is missing: install it with `apt-get install {pkg}` (Debian/Ubuntu)"
    return f"shared library {lib} is missing: install the system package that provides it"


def check_shared_libraries(binary: Path) -> None:
    ldd = shutil.which("ldd")
    if not ldd:
        return
    try:
        out = subprocess.run([ldd, str(binary)], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return
    missing = re.findall(r"^\s*(\S+) => not found", out, re.M)
    if missing:
        hints = [missing_library_hint(f"{lib}: cannot open shared object file") for lib in missing]
        raise StoreError(f"cannot run {binary.name}: " + "; ".join(h for h in hints if h))
