"""A fork server for the pipeline's jobs: the libraries are imported once, each job is a fork.

A tiny run's jobs spend a quarter of their CPU importing torch, transformers, lm-eval and mlflow
(docs/performance.md). With `RPB_JOB_SERVER` set (the Snakefile sets it when the config's
`job_server` is true), the `rpb` command hands its job to a server process that has imported
them, and waits: the server forks, the child takes the client's working directory, environment
and standard streams (passed over a Unix socket), runs the job as a fresh process would, and
exits; the client exits with its status. SIGTERM/SIGINT to the client are forwarded to the
child, so cancelling a job still ends its MLflow run KILLED.

The first client starts the server (a detached process) if none answers; a server exits after
`IDLE_SECONDS` without jobs. Its socket is in Linux's abstract namespace (no file to go stale),
named after the user, the value of `RPB_JOB_SERVER` and the state of the `rpb` sources, so edited
code gets a new server. Anything that fails before a job has started in the server falls back
to running the job in the client's own process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

SERVER_ENV = "RPB_JOB_SERVER"
IDLE_SECONDS = 120  # RPB_JOB_SERVER_IDLE overrides
START_TIMEOUT = 120  # seconds a client waits for a server it started to answer
# What the server imports before it forks: every job stage's libraries, and what they import
# lazily on first use (MLflow's sqlite store and git context, lm-eval's helpers), found by
# listing the modules a `rpb run` imports after these.
PRELOAD = (
    "rpb.cli",
    "rpb.training",
    "rpb.evaluation",
    "rpb.analysis",
    "rpb.tracking",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.db.utils",
    "mlflow.tracing.processor.otel",
    "alembic.command",
    "alembic.config",
    "git",
    "cryptography.fernet",
    "pygments.lexers",
    "pygments.formatters.html",
    "scipy.io",
    "lm_eval.evaluator",
    "lm_eval.models.huggingface",
    "lm_eval.tasks",
)


def address(key: str) -> str:
    """Abstract socket name for server key `key` and the current `rpb` sources."""
    package = Path(__file__).resolve().parent
    state = [f"{os.getuid()}", key, str(package)]
    for path in sorted(package.glob("*.py")):
        stat = path.stat()
        state.append(f"{path.name}:{stat.st_mtime_ns}:{stat.st_size}")
    digest = hashlib.sha256("\n".join(state).encode()).hexdigest()[:24]
    return f"\0rpb-job-server-{digest}"


def _connect(name: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return None
    return sock


def _start_server(key: str) -> None:
    subprocess.Popen(
        [sys.executable, "-m", "rpb.jobserver", key],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("job server closed the connection")
        data += chunk
    return data.decode().strip()


def run_via_server(argv: Sequence[str]) -> int | None:
    """Run `rpb argv` in the job server named by RPB_JOB_SERVER; its exit status, or None when
    no server could take the job (the caller then runs it itself)."""
    key = os.environ.get(SERVER_ENV)
    if not key or not sys.platform.startswith("linux"):
        return None
    name = address(key)
    sock = _connect(name)
    if sock is None:
        _start_server(key)
        deadline = time.monotonic() + START_TIMEOUT
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.05)
            sock = _connect(name)
        if sock is None:
            return None
    with sock:
        request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ)}
        try:
            socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
            pid = int(_read_line(sock))
        except (OSError, ValueError, ConnectionError):
            return None

        def forward(signum: int, frame: object) -> None:
            os.kill(pid, signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        try:
            return int(_read_line(sock))
        except (OSError, ValueError, ConnectionError):
            return 1  # the server died under the job


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's job, run it, never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch

        # A fresh process takes its thread count from OMP_NUM_THREADS (Snakemake's {threads}).
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        sys.argv = ["rpb", *request["argv"]]
        from rpb.cli import main

        code = main(request["argv"])
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        from rpb.cli import _exit_now

        _exit_now(code)


def serve(key: str) -> None:
    """Import the job libraries, then fork one child per job until idle for IDLE_SECONDS."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(key))
    except OSError:  # another client's server won the race
        return
    import importlib

    for module in PRELOAD:
        # An optional helper that is missing only costs its import in the job.
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    listener.listen(64)
    jobs: dict[int, socket.socket] = {}  # child pid -> its client's connection
    idle = float(os.environ.get("RPB_JOB_SERVER_IDLE", IDLE_SECONDS))
    idle_since = time.monotonic()
    while jobs or time.monotonic() - idle_since < idle:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message.decode())
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _run_child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            jobs[pid] = conn
        while jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is not None:
                with conn:
                    try:
                        code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
                        conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
                    except OSError:
                        pass
            idle_since = time.monotonic()


if __name__ == "__main__":
    serve(sys.argv[1])
