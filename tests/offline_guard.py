"""Cut tests (and the processes they start) off the network.

Two layers, because either alone can be missing:

- `install()` patches Python's socket module so that name lookups of non-local hosts and
  connections to non-loopback addresses raise `NetworkAccessError`. Subprocesses get it through a
  generated `sitecustomize.py` on `PYTHONPATH` (`guarded_env`), which Python imports at startup.
- `unshare_prefix()` runs a command in a new network namespace (`unshare --net`, needs root or
  user namespaces) with only loopback up: a real cut, covering code that does not go through
  Python's socket module (libc resolvers, native extensions).

Run any command both ways, e.g. the whole suite:

    .venv/bin/python tests/offline_guard.py .venv/bin/pytest -q
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

GUARD_ENV = "RPB_OFFLINE_GUARD"
LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", ""}


class NetworkAccessError(OSError):
    """A test tried to reach the network."""


_originals: dict[str, Any] = {}


def _is_local(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _check(family: int, address: Any) -> None:
    if family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        raise NetworkAccessError(f"offline test tried to reach {address!r}")


def _connect(self: socket.socket, address: Any) -> Any:
    _check(self.family, address)
    return _originals["connect"](self, address)


def _connect_ex(self: socket.socket, address: Any) -> Any:
    _check(self.family, address)
    return _originals["connect_ex"](self, address)


def _sendto(self: socket.socket, data: Any, *args: Any) -> Any:
    _check(self.family, args[-1])
    return _originals["sendto"](self, data, *args)


def _getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if host is not None and not _is_local(host):
        try:  # a numeric address needs no lookup; connecting to it is checked above
            ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host)
        except ValueError:
            raise NetworkAccessError(f"offline test tried to look up {host!r}") from None
    return _originals["getaddrinfo"](host, *args, **kwargs)


def install() -> None:
    """Make non-local lookups and connections raise `NetworkAccessError` in this process."""
    if _originals:
        return
    _originals.update(
        connect=socket.socket.connect,
        connect_ex=socket.socket.connect_ex,
        sendto=socket.socket.sendto,
        getaddrinfo=socket.getaddrinfo,
    )
    socket.socket.connect = _connect
    socket.socket.connect_ex = _connect_ex
    socket.socket.sendto = _sendto
    socket.getaddrinfo = _getaddrinfo


def uninstall() -> None:
    """Undo `install()`."""
    if not _originals:
        return
    socket.socket.connect = _originals.pop("connect")
    socket.socket.connect_ex = _originals.pop("connect_ex")
    socket.socket.sendto = _originals.pop("sendto")
    socket.getaddrinfo = _originals.pop("getaddrinfo")


def sitecustomize_dir(folder: Path) -> Path:
    """Write a `sitecustomize.py` into `folder` that installs this guard at interpreter start."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('rpb_offline_guard', {__file__!r})\n"
        "_guard = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_guard)\n"
        "_guard.install()\n"
    )
    return folder


def guarded_env(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` for a subprocess whose Python processes (and theirs) install the guard at start."""
    env = dict(env)
    site = str(sitecustomize_dir(folder))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    env[GUARD_ENV] = "1"
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env.pop(proxy, None)
    return env


def unshare_prefix() -> list[str]:
    """Command prefix that runs in a fresh network namespace with loopback up, or [] if this
    machine does not allow it (no unshare, no root/user namespaces)."""
    if not shutil.which("unshare"):
        return []
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        return []
    lo_up = "ip link set lo up 2>/dev/null || true; " if shutil.which("ip") else ""
    return ["unshare", "--net", "sh", "-c", f'{lo_up}exec "$@"', "offline"]


def main(argv: list[str]) -> int:
    """Run `argv` with the guard, inside a network namespace when possible; return its code."""
    if not argv:
        print("usage: offline_guard.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"rpb_offline_guard_{os.getpid()}"
    prefix = unshare_prefix()
    if not prefix:
        print("offline_guard: no network namespace here, socket guard only", file=sys.stderr)
    return subprocess.run([*prefix, *argv], env=guarded_env(dict(os.environ), folder)).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
