"""A fork server for the pipeline's jobs: the libraries are imported once, each job is a fork.

A tiny run's jobs spend a quarter of their CPU importing torch, transformers, lm-eval and mlflow
(docs/performance.md). With `RPB_JOB_SERVER` set (the Snakefile sets it to the results folder
when the config's `job_server` is true), the `rpb` command hands its job to a server process that
has imported them, and waits: the server forks, the child takes the client's working directory,
environment and standard streams (passed over a Unix socket), runs the job as a fresh process
would, and exits; the client exits with its status. SIGTERM/SIGINT to the client are forwarded to
the child, so cancelling a job still ends its MLflow run KILLED.

The server serves its owner only (docs/records/reliability.md, section 12): its socket is a file
in a directory only the owner can enter (`private_dir`: 0700, owned by the user, checked; anything
else is refused), and it refuses every connection whose peer credentials (SO_PEERCRED) name
another uid before reading a byte of it.

The socket's name depends on the user, the value of `RPB_JOB_SERVER` and the interpreter only,
never on where `rpb` was imported from: the client computes it and starts the server with its own
interpreter and its own copy of `rpb`, and every request names that copy and the state of its
sources. A server holding another copy or older sources answers `stale`, stops listening and
exits once its jobs are done; the client starts a fresh one. The first client starts the server
if none answers; a server exits after `IDLE_SECONDS` without jobs. Whenever no server takes the
job within seconds (none can be started, the directory is unsafe, a server does not answer), the
client says so in one line on stderr and runs the job in its own process.

The server runs a job by calling the command's entry point, `job(argv) -> exit status`, handed to
`serve`/`main` by the server's start-up script (`_start_server`: `rpb.pipeline.cli.main`); this
module imports no other rpb module, so rpb.pipeline.cli may import it. A finished job ends with
`exit_now`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SERVER_ENV = "RPB_JOB_SERVER"
DIR_ENV = "RPB_JOB_SERVER_DIR"  # where the sockets live (default: private_dir's choice)
IDLE_SECONDS = 120  # RPB_JOB_SERVER_IDLE overrides
CONNECT_TIMEOUT = 10.0  # s a client waits for a server it started to listen (it binds first)
ANSWER_TIMEOUT = 5.0  # s a client waits for a server's first answer to a request
PRELOAD_TIMEOUT = 300.0  # s a client waits for a server that queued its job while importing
REQUEST_TIMEOUT = 5.0  # s the server waits for a connected client's request
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
# The variables that choose a process's CPU kernels at its start (rpb.numerics' KERNEL_ENV and
# PIN_ENV; spelled here because this module imports no other rpb module).
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "RPB_CPU_NUMERICS")
# What the server imports before it forks: every job stage's libraries, and what they import
# lazily on first use (MLflow's sqlite store and git context, lm-eval's helpers), found by
# listing the modules a `rpb pipeline run` imports after these.
PRELOAD = (
    "rpb.pipeline.cli",
    "rpb.pipeline.training",
    "rpb.pipeline.evaluation",
    "rpb.pipeline.analysis",
    "rpb.pipeline.tracking",
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


# A job's entry point: the rpb command's `main`, run on the job's arguments, -> exit status.
Job = Callable[[Sequence[str]], int]


class Unavailable(Exception):
    """No server can take the job; the message says why (one line)."""


def exit_now(code: int) -> None:
    """End a finished job without the interpreter's teardown (freeing thousands of modules,
    torch's and mlflow's exit hooks): about 2 CPU-seconds per job, measured in
    docs/performance.md. Everything the job wrote is closed or flushed by then; logs are
    flushed here. The `rpb` command ends with it too when it runs a job in its own process."""
    from rpb.pipeline.results_folder import drop_job_files

    drop_job_files()  # the exit hooks that would remove the job's file are skipped
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --------------------------------------------------------------------------- addresses


def _check_private(path: Path) -> None:
    """Refuse `path` unless it is a real directory (not a link) owned by this user that no one
    else may enter, list or write: another user who could would reach (or replace) the socket."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise Unavailable(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise Unavailable(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    if info.st_mode & 0o077:
        raise Unavailable(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o}, needs 0700)"
        )


def private_dir() -> Path:
    """This user's directory for job server sockets, created 0700 if missing and checked:
    $RPB_JOB_SERVER_DIR, else $XDG_RUNTIME_DIR/rpb (the runtime directory is private to the
    user already), else /tmp/rpb-<uid>. Not TMPDIR: every job of a pipeline must find the
    same server, and a batch system may give each job its own TMPDIR."""
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        path = Path(chosen)
    else:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        try:
            if not runtime:
                raise Unavailable("no XDG_RUNTIME_DIR")
            _check_private(Path(runtime))
            path = Path(runtime) / "rpb"
        except (Unavailable, OSError):
            path = Path("/tmp") / f"rpb-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)  # created private; an existing one is checked below
    _check_private(path)
    return path


def address(key: str) -> str:
    """The socket path of the job server for key `key` (the results folder) run by this
    interpreter: the same for a client and the server it starts whatever copy of `rpb` either
    imports (the copy is checked per request instead). Raises Unavailable if the directory is
    unsafe or the path too long for a Unix socket."""
    state = "\n".join([str(os.getuid()), key, sys.executable])
    digest = hashlib.sha256(state.encode()).hexdigest()[:24]
    path = str(private_dir() / f"{digest}.sock")
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise Unavailable(f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes")
    return path


def identity() -> dict[str, str]:
    """Which `rpb` this process runs: its package folder and the state of its sources."""
    package = Path(__file__).resolve().parents[1]  # rpb/, all three wings
    state = []
    for path in sorted(package.rglob("*.py")):
        info = path.stat()
        state.append(f"{path.relative_to(package)}:{info.st_mtime_ns}:{info.st_size}")
    return {
        "package": str(package),
        "sources": hashlib.sha256("\n".join(state).encode()).hexdigest(),
        # ATen and MKL fix their kernels when the server starts (rpb.numerics): a server
        # started under another numeric path must not run this job.
        "numerics": " ".join(f"{name}={os.environ.get(name, '')}" for name in NUMERIC_ENV),
    }


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (from the kernel)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


# --------------------------------------------------------------------------- client


def _start_server(key: str, path: str) -> subprocess.Popen[bytes]:
    """A detached server on `path`, run by this interpreter with this process's copy of `rpb`
    first on its path (not the working directory's, which `python -m` would pick). The script is
    the server's entry point: it hands the `rpb` command's main to `main` as the job."""
    root = str(Path(__file__).resolve().parents[2])  # above rpb/
    code = (
        "import sys; sys.path.insert(0, sys.argv.pop(1)); "
        "from rpb.pipeline import cli, jobserver; jobserver.main(cli.main)"
    )
    with open(path + ".log", "wb") as log:  # the server's own errors (jobs use the client's)
        return subprocess.Popen(
            [sys.executable, "-c", code, root, key, path],
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )


def _await_server(path: str, server: subprocess.Popen[bytes]) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        sock = _connect(path)
        if sock is not None:
            return sock
        code = server.poll()
        if code is not None:  # it exited: another client's server may have won the race
            sock = _connect(path)
            if sock is not None:
                return sock
            raise Unavailable(f"the server it started exited with status {code} (log: {path}.log)")
        if time.monotonic() > deadline:
            raise Unavailable(f"the server it started did not listen within {CONNECT_TIMEOUT:g} s")
        time.sleep(0.05)


class _Lines:
    """The server's answers, one line at a time (two may arrive in one read: `queued` and
    `send`, or a fast job's pid and status)."""

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock, self.path, self.buffer = sock, path, b""

    def next(self, timeout: float | None) -> str:
        self.sock.settimeout(timeout)
        try:
            while b"\n" not in self.buffer:
                chunk = self.sock.recv(4096)
                if not chunk:
                    raise ConnectionError("it closed the connection")
                self.buffer += chunk
        except TimeoutError:
            raise Unavailable(f"no answer from {self.path} within {timeout:g} s") from None
        except (OSError, ConnectionError) as err:
            raise Unavailable(f"{self.path} dropped the job ({err})") from None
        finally:
            self.sock.settimeout(None)
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode().strip()


def _follow(lines: _Lines, pid: int) -> int:
    """Wait for the served job's exit status, forwarding SIGTERM/SIGINT to it."""

    def forward(signum: int, frame: object) -> None:
        os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return int(lines.next(None))
    except (Unavailable, ValueError):
        return 1  # the server died under the job


def _submit(key: str, path: str, argv: Sequence[str]) -> int:
    """Hand the job to the server on `path` (started if none listens); its exit status.

    The standard streams go only once the server asks for them (`send`): a server that does not
    answer never holds them, so whoever reads the client's output still sees it end."""
    request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "rpb": identity()}
    payload = json.dumps(request).encode() + b"\n"
    for _ in range(2):  # a stale server retires before it answers: then start a fresh one
        sock = _connect(path)
        if sock is None:
            sock = _await_server(path, _start_server(key, path))
        with sock:
            if _peer_uid(sock) != os.getuid():  # the directory check makes this impossible
                raise Unavailable(f"the socket {path} belongs to uid {_peer_uid(sock)}")
            try:
                sock.sendall(payload)
            except OSError as err:
                raise Unavailable(f"the job could not be sent to {path} ({err})") from None
            lines = _Lines(sock, path)
            reply = lines.next(ANSWER_TIMEOUT)
            if reply == "stale":
                continue
            if reply == "queued":  # a fresh server is still importing the libraries
                reply = lines.next(PRELOAD_TIMEOUT)
            if reply != "send":
                raise Unavailable(f"{path} answered {reply[:40]!r}")
            try:
                socket.send_fds(sock, [b"\0"], [0, 1, 2])
            except OSError as err:
                raise Unavailable(f"{path} dropped the job ({err})") from None
            reply = lines.next(ANSWER_TIMEOUT)
            try:
                pid = int(reply)
            except ValueError:
                raise Unavailable(f"{path} answered {reply[:40]!r}") from None
            return _follow(lines, pid)
    raise Unavailable("the server kept retiring (another copy of rpb starts it too?)")


def run_via_server(argv: Sequence[str]) -> int | None:
    """Run `rpb argv` in the job server named by RPB_JOB_SERVER; its exit status, or None when
    no server could take the job (said in one line on stderr; the caller then runs it itself)."""
    key = os.environ.get(SERVER_ENV)
    if not key or not sys.platform.startswith("linux"):
        return None
    try:
        return _submit(key, address(key), argv)
    except (Unavailable, OSError) as why:
        print(f"rpb: job server not used: {why}; running the job in this process", file=sys.stderr)
        return None


# --------------------------------------------------------------------------- server


def _run_child(request: dict, fds: list[int], job: Job) -> None:
    """In the forked child: become the client's job, run it (`job(argv)`), never return."""
    code = 1
    try:
        # Its own process group, so that the server can end the job with all it started when
        # the client goes away (`_Server.watch`); the server sets it too, whoever runs first.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
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
        code = job(request["argv"])
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        exit_now(code)


def _receive(conn: socket.socket) -> dict[str, Any] | None:
    """A connection's job request, or None (connection closed): another uid's connection is
    closed before anything of it is read."""
    try:
        pid, uid, _ = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        if uid != os.getuid():
            print(
                f"rpb job server: refused a connection from uid {uid} (pid {pid})", file=sys.stderr
            )
            conn.close()
            return None
        conn.settimeout(REQUEST_TIMEOUT)  # a silent client must not hold the server
        message = b""
        while not message.endswith(b"\n"):
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the client hung up")
            message += chunk
        conn.settimeout(None)
        request = json.loads(message.decode())
        if not isinstance(request, dict):
            raise ValueError("not a job request")
    except (OSError, ValueError, ConnectionError):
        conn.close()
        return None
    return request


def _streams(conn: socket.socket) -> list[int] | None:
    """Ask the client for its standard streams; None if it hung up (it gave up waiting and
    runs the job itself) or sent something else."""
    fds: list[int] = []
    try:
        conn.sendall(b"send\n")
        conn.settimeout(REQUEST_TIMEOUT)
        message, fds, _, _ = socket.recv_fds(conn, 1, 3)
        conn.settimeout(None)
    except OSError:
        message = b""
    if message and len(fds) == 3:
        return fds
    for fd in fds:
        os.close(fd)
    return None


class _Listener:
    """The server's socket: bound under a lock (a live server's socket is left alone, a dead
    one's file replaced), retired by unlinking it if it is still ours."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        with open(Path(path).parent / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.lexists(path):
                live = _connect(path)
                if live is not None:  # another client's server won the race
                    live.close()
                    return
                os.unlink(path)  # left by a server that was killed
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(64)
        self.inode = os.stat(path).st_ino
        self.sock = sock

    def retire(self) -> None:
        """Stop taking jobs: the next client starts another server on the same path."""
        if self.sock is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        self.sock.close()
        self.sock = None


class _Server:
    def __init__(self, path: str, job: Job) -> None:
        self.job = job
        self.listener = _Listener(path)
        self.identity = identity()
        self.queued: list[tuple[socket.socket, dict[str, Any]]] = []
        self.jobs: dict[int, socket.socket] = {}  # child pid -> its client's connection
        self.orphans: set[int] = set()  # jobs killed because their client went away

    def take(self, conn: socket.socket) -> dict[str, Any] | None:
        """A connection's request if this server may run it; a client of another copy of rpb
        (or of edited sources) is told `stale`, and this server stops listening."""
        request = _receive(conn)
        if request is not None and request.get("rpb") != self.identity:
            self.listener.retire()  # before answering: the client starts a fresh server
            with contextlib.suppress(OSError):
                conn.sendall(b"stale\n")
            conn.close()
            return None
        return request

    def accept(self, timeout: float) -> socket.socket | None:
        """A new connection, if one comes within `timeout`; meanwhile watch the running jobs'
        clients (`watch`)."""
        sock = self.listener.sock
        clients = {conn: pid for pid, conn in self.jobs.items() if pid not in self.orphans}
        ready, _, _ = select.select([*([sock] if sock else []), *clients], [], [], timeout)
        for conn in ready:
            if conn in clients:
                self.watch(conn, clients[conn])
        return sock.accept()[0] if sock is not None and sock in ready else None

    def watch(self, conn: socket.socket, pid: int) -> None:
        """A running job's client holds its connection open, silent, for the job's life: end of
        file means it is gone (SIGKILLed with Snakemake's process group, say), and the job with
        it, as a job in the client's own process would be. Else the fork ran on after the
        results lock was released, and the recovery started the same job beside it."""
        try:
            data = conn.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:  # a client never writes after its streams; not a hang-up
            return
        self.orphans.add(pid)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the job and every process it started
        print(f"rpb job server: the client of job {pid} went away; job killed", file=sys.stderr)

    def queue_while(self, busy: threading.Event) -> None:
        """While the main thread imports the libraries: answer `queued` to every job (so its
        client knows the server is alive) and keep it for later."""
        while busy.is_set():
            conn = self.accept(0.05)
            request = None if conn is None else self.take(conn)
            if conn is not None and request is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(b"queued\n")
                self.queued.append((conn, request))

    def start(self, conn: socket.socket, request: dict[str, Any]) -> None:
        fds = _streams(conn)
        if fds is None:
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            # The child keeps only its own streams: other clients must see the server's end.
            if self.listener.sock is not None:
                self.listener.sock.close()
            for other in [conn, *self.jobs.values(), *(q[0] for q in self.queued)]:
                other.close()
            _run_child(request, fds, self.job)
        with contextlib.suppress(OSError):  # as the child does: the group exists at once
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.sendall(f"{pid}\n".encode())
        self.jobs[pid] = conn

    def reap(self) -> bool:
        """Report finished jobs to their clients; whether any finished."""
        done = False
        while self.jobs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = self.jobs.pop(pid, None)
            self.orphans.discard(pid)
            if conn is not None:
                done = True
                with conn, contextlib.suppress(OSError):
                    code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
                    conn.sendall(f"{code if code >= 0 else 128 - code}\n".encode())
        return done


def serve(key: str, path: str | None = None, *, job: Job) -> None:
    """Listen on `path` (default: this process's address for `key`), import the job libraries,
    then fork one child per job, which runs `job(argv)`, until idle for IDLE_SECONDS (or
    retired)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    path = path or address(key)
    _check_private(Path(path).parent)  # the server checks the directory too
    server = _Server(path, job)
    if server.listener.sock is None:
        return
    import importlib

    # Jobs that arrive while the libraries load are acknowledged by a thread; it is joined
    # before the first fork, so no job is forked from a process with another thread.
    busy = threading.Event()
    busy.set()
    acker = threading.Thread(target=server.queue_while, args=(busy,), daemon=True)
    acker.start()
    try:
        for module in PRELOAD:
            # An optional helper that is missing only costs its import in the job.
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
    finally:
        busy.clear()
        acker.join()
    idle = float(os.environ.get("RPB_JOB_SERVER_IDLE", IDLE_SECONDS))
    idle_since = time.monotonic()
    try:
        while (
            server.jobs
            or server.queued
            or (server.listener.sock is not None and time.monotonic() - idle_since < idle)
        ):
            while server.queued:
                server.start(*server.queued.pop(0))
            conn = server.accept(0.05)
            request = None if conn is None else server.take(conn)
            if conn is not None and request is not None:
                server.start(conn, request)
            if server.reap():
                idle_since = time.monotonic()
    finally:
        server.listener.retire()


def main(job: Job) -> None:
    """`python -c ... key path`, as a client starts it (see _start_server): serve `job`."""
    serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, job=job)
