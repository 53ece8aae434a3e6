"""The network guard of tests/offline_guard.py works: in this process, in child processes, and as a
network namespace. The pipeline itself is run under it by test_determinism.py: two smoke runs, in
a namespace without network where available, with the socket guard in every job (its launcher
checks) and with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from offline_guard import (
    GUARD_ENV,
    NetworkAccessError,
    guarded_env,
    install,
    uninstall,
    unshare_prefix,
)

# TEST-NET-1 (RFC 5737): never routed, so a leak cannot reach anyone.
REMOTE = ("192.0.2.1", 80)


@pytest.fixture
def guard() -> Iterator[None]:
    install()
    yield
    uninstall()


def _loopback_roundtrip() -> bytes:
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname(), timeout=5) as client,
    ):
        conn, _ = server.accept()
        with conn:
            client.sendall(b"ping")
            return conn.recv(4)


def test_guard_blocks_remote_but_not_loopback(guard: None) -> None:
    with pytest.raises(NetworkAccessError, match=r"192\.0\.2\.1"):
        socket.create_connection(REMOTE, timeout=1)
    with pytest.raises(NetworkAccessError, match=r"huggingface\.co"):
        socket.getaddrinfo("huggingface.co", 443)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with udp, pytest.raises(NetworkAccessError):
        udp.sendto(b"x", ("8.8.8.8", 53))
    assert _loopback_roundtrip() == b"ping"


def test_guard_reaches_subprocesses(tmp_path: Path) -> None:
    """The hub client in a child process fails on the guard (HF offline mode deliberately off)."""
    env = guarded_env(dict(os.environ), tmp_path / "site")
    env.pop("HF_HUB_OFFLINE", None)
    code = "import huggingface_hub; huggingface_hub.model_info('gpt2')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "offline test tried to" in proc.stderr, proc.stderr[-2000:]


def test_network_namespace_has_no_route_but_loopback() -> None:
    prefix = unshare_prefix()
    if not prefix:
        pytest.skip("no network namespaces on this machine (needs root or user namespaces)")
    code = (
        "import socket, sys\n"
        "s = socket.socket(); s.settimeout(5)\n"
        f"print(s.connect_ex({REMOTE!r}))\n"
        "srv = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection("
        "srv.getsockname()); print('loopback ok')\n"
    )
    # Without the socket guard (inherited when the whole suite runs under it): the cut is real.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", GUARD_ENV)}
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(errno.ENETUNREACH), "loopback", "ok"]
