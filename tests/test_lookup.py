"""The scheduler-to-worker lookup channel: its socket path and its replies."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from lmcache_mooncake.connector import lookup as lk
from lmcache_mooncake.connector.lookup import LookupClient, LookupReply, LookupServer, lookup_socket_path


@pytest.fixture
def deep_run_dir(tmp_path):
    d = tmp_path.joinpath(*(["a-rather-long-folder-name"] * 6))
    d.mkdir(parents=True)
    assert len(str(d / "lookup-0123456789ab.sock").encode()) > lk.MAX_SOCKET_PATH
    return d


def test_socket_path_is_short_and_shared_by_both_sides(deep_run_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = lookup_socket_path(deep_run_dir, "engine-1")
    assert len(str(path).encode()) <= lk.MAX_SOCKET_PATH
    # The scheduler and the worker derive it independently: the same path.
    assert lookup_socket_path(deep_run_dir, "engine-1") == path
    # Another engine, data-parallel rank or run folder: another socket.
    others = {lookup_socket_path(deep_run_dir, "engine-2"), lookup_socket_path(deep_run_dir, "engine-1", 1),
              lookup_socket_path(tmp_path, "engine-1")}
    assert path not in others and len(others) == 3
    st = path.parent.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_socket_folder_prefers_a_short_xdg_runtime_dir(monkeypatch, tmp_path, deep_run_dir):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    if len(str(xdg)) <= 60:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        assert lookup_socket_path(deep_run_dir, "e").parent == xdg / "lmcache-mooncake"
    # One too long to leave room for the name is not used.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep_run_dir))
    assert lookup_socket_path(deep_run_dir, "e").parent == lk.Path("/tmp") / f"lmcache-mooncake-{os.getuid()}"


def test_socket_folder_open_to_others_is_refused(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(lk, "_runtime_dir", lambda: shared)
    with pytest.raises(PermissionError, match="mode 0700"):
        lookup_socket_path(tmp_path, "e")


def test_lookup_over_a_deep_run_dir_returns_the_tier_runs(deep_run_dir):
    path = lookup_socket_path(deep_run_dir, "engine-rt")
    reply = LookupReply(hit=600, runs=[("cpu", 256), ("disk", 600)])
    server = LookupServer(path, lambda tokens, salt, lora: reply if tokens == [1, 2, 3] else LookupReply(hit=0))
    client = LookupClient(path, timeout=5.0)
    try:
        got = client.lookup([1, 2, 3], None, None)
        assert (got.hit, got.runs) == (reply.hit, reply.runs)
        got = client.lookup([4], "salt", None)
        assert (got.hit, got.runs) == (0, [])
    finally:
        client.close()
        server.close()
    assert not path.exists()  # removed on close


def test_questions_stay_open_until_answered_and_late_answers_are_dropped(tmp_path):
    import threading
    import time

    release = threading.Event()

    def lookup(tokens, salt, lora):
        if tokens == [9]:
            release.wait(10)  # a slow lookup (a long prompt read from disk)
        return LookupReply(hit=len(tokens))

    path = lookup_socket_path(tmp_path, "engine-open")
    server = LookupServer(path, lookup)
    client = LookupClient(path, timeout=1.0)
    try:
        assert client.ask("slow", [9], None, None, wait=0.01) is None
        assert client.is_open("slow")
        # Answered by the server's other worker while the slow one runs.
        assert client.ask("quick", [1, 2], None, None, wait=2.0) == LookupReply(hit=2, id=2)
        assert client.ask("slow", [9], None, None, wait=0.01) is None
        # Open longer than the timeout: a miss, and the question is closed.
        time.sleep(1.0)
        assert client.ask("slow", [9], None, None, wait=0.01) == LookupReply(hit=0)
        assert not client.is_open("slow")
        # A question whose request ended is cancelled.
        assert client.ask("gone", [9], None, None, wait=0.01) is None
        client.cancel("gone")
        assert not client.is_open("gone")
        release.set()
        # Neither late answer (both hit=1) answers the next question.
        assert client.ask("next", [1, 2, 3], None, None, wait=2.0).hit == 3
        assert client.lookup([5, 6], None, None).hit == 2
    finally:
        release.set()
        client.close()
        server.close()


def test_a_reply_without_runs_decodes_with_none():
    # What a worker of the previous release sends.
    old = msgspec.msgpack.encode({"hit": 512})
    assert msgspec.msgpack.decode(old, type=LookupReply) == LookupReply(hit=512, runs=[])


def test_stale_sockets_of_killed_workers_are_removed(tmp_path):
    import socket
    import time

    dead, young, live = (tmp_path / f"lookup-{n}.sock" for n in ("dead", "young", "live"))
    for p in (dead, young):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(p))  # bound, then closed: what a killed worker leaves
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live))
    listener.listen()
    old = time.time() - 3600
    for p in (dead, live):
        os.utime(p, (old, old))
    try:
        assert lk.remove_stale_sockets(tmp_path) == 1
        assert not dead.exists() and young.exists() and live.exists()
    finally:
        listener.close()
