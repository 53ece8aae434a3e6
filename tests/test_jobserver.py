"""The job server (rpb.pipeline.jobserver): a job handed to it behaves as the same `rpb` command run
in its own process (outputs, exit status, error line on the client's stderr); it serves its owner
only (another uid is refused at the directory and, past it, by its peer credentials, and nothing
runs); client and server agree on its address whatever copy of `rpb` each imports; and a server
that cannot be used or does not answer costs one line on stderr and seconds, not the job."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rpb.pipeline import jobserver
from rpb.pipeline.jobserver import DIR_ENV, SERVER_ENV, _connect, address, identity, run_via_server

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
FALLBACK = "rpb: job server not used: "


@pytest.fixture
def sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private socket directory of this test's own (short: a socket path has 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rpb-test-", dir="/tmp"))  # created 0700
    monkeypatch.setenv(DIR_ENV, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _client(tmp_path: Path) -> list[str]:
    """The `rpb` command as a console script runs it: its own folder, not the working directory,
    first on sys.path (so a copy of rpb in the working directory is not what it imports)."""
    script = tmp_path / "bin" / "rpb"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\nfrom rpb.pipeline.cli import main\nsys.exit(main())\n")
    return [sys.executable, str(script)]


def _env(key: str, sockets: Path, idle: float = 30) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", RPB_JOB_SERVER_IDLE=str(idle))
    env.update({SERVER_ENV: key, DIR_ENV: str(sockets)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _server_pid(path: str) -> int:
    sock = _connect(path)
    assert sock is not None, f"no job server answers at {path}"
    with sock:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _stop(pid: int) -> None:
    """End the server this test started (by its pid) and wait until it is gone."""
    os.kill(pid, signal.SIGTERM)
    for _ in range(200):
        if not Path(f"/proc/{pid}").exists() or "Z" in _state(pid):
            return
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def _raw_request(path: str, request: dict) -> str:
    """Send a job request line by hand; everything the server answers until it hangs up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    return data.decode()


@pytest.mark.slow  # end to end: client and server processes, a job run through them
def test_a_served_job_writes_its_outputs_and_reports_errors(tmp_path: Path, sockets: Path) -> None:
    """Run from a working directory that holds another copy of rpb (a broken one): the server is
    started with the client's interpreter and copy, answers at the client's address, and a client
    of another copy (or of edited sources) makes it retire."""
    key = f"test-{tmp_path}"
    env = _env(key, sockets)
    decoy = tmp_path / "work" / "rpb"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the working directory copy of rpb')\n")
    store = tmp_path / "mlflow.db"
    rpb = _client(tmp_path)
    ok = subprocess.run(
        [*rpb, "pipeline", "init-tracking", "--tracking-uri", f"sqlite:///{store}"],
        cwd=decoy.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ok.returncode == 0, ok.stderr
    assert FALLBACK not in ok.stderr  # served: the job did not run in the client
    assert store.is_file() and "MLflow store ready" in ok.stderr  # the job's log reached us
    path = address(key)
    pid = _server_pid(path)  # the first client started it
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].decode() == sys.executable  # the client's interpreter
        assert str(ROOT) in [c.decode() for c in cmdline]  # and the client's copy of rpb
        eval_args = ["--name", "m", "--label", "x", "--model", "missing", "--eval-dir", "."]
        eval_args += ["--tasks", "math", "--work", "w", "--out", "o.json"]
        bad = subprocess.run(
            [*rpb, "pipeline", "eval", *eval_args, "--tracking-uri", f"sqlite:///{store}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        # Bad input: the same one-line error and status as without the server.
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith("rpb pipeline eval: error:")
        assert FALLBACK not in bad.stderr
        # A client of another copy of rpb: the server answers `stale` and stops listening.
        other = {"package": "/elsewhere/rpb", "sources": identity()["sources"]}
        request = {"argv": ["--help"], "cwd": str(tmp_path), "env": env, "rpb": other}
        assert _raw_request(path, request) == "stale\n"
        assert not os.path.exists(path)
    finally:
        _stop(pid)


# Speaks the protocol with the standard library only: the request line, then the standard
# streams when the server asks for them (`send`), then every line until the server hangs up.
ATTACKER = r"""
import socket, sys
path, request = bytes.fromhex(sys.argv[1]), sys.stdin.buffer.read()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(path)
except OSError as err:
    sys.exit(f"connect: {type(err).__name__}")
lines = []
try:
    sock.sendall(request)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
        while b"\n" in data:
            line, data = data.split(b"\n", 1)
            lines.append(line.decode())
            if line == b"send":
                socket.send_fds(sock, [b"\0"], [0, 1, 2])
except OSError as err:
    sys.exit(f"refused: {type(err).__name__}")
sys.exit(f"answer: {lines}" if lines else "refused: closed")
"""


def _as(uid: int | None, path: str, request: dict, *, dac_override: bool = False) -> str:
    """Send `request` to the socket `path` from a process of `uid` (None: this one's), written
    with the standard library only, as an attacker would; what it saw (its last line)."""
    cmd = [sys.executable, "-I", "-S", "-c", ATTACKER, os.fsencode(path).hex()]
    if uid is not None:
        switch = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        if dac_override:  # past the directory's permissions, as root-like helpers are
            switch += ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
        cmd = [*switch, *cmd]
    out = subprocess.run(
        cmd, input=json.dumps(request).encode() + b"\n", capture_output=True, timeout=600
    )
    return out.stderr.decode().strip().splitlines()[-1]  # after the job's own log, if it ran


def _can_switch(dac_override: bool = False) -> bool:
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if dac_override:
        cmd += ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    try:
        return subprocess.run([*cmd, "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow  # end to end: client and server processes, a job run through them
@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another uid needs root")
def test_another_user_is_refused_and_nothing_runs(
    tmp_path: Path, sockets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nobody` sends the owner a job (one that writes a file the owner's uid can write and
    nobody cannot): refused at the 0700 directory, and, holding CAP_DAC_OVERRIDE to get past
    it, refused by the server's peer-credential check before it reads the request; the file
    never appears. The same request from the owner runs (so the server was there to refuse)."""
    if not _can_switch():
        pytest.skip("setpriv cannot switch to uid 65534 here")
    key = f"test-{tmp_path}"
    env = _env(key, sockets)
    monkeypatch.setenv("RPB_JOB_SERVER_IDLE", "60")  # the server inherits it
    path = address(key)
    server = jobserver._start_server(key, path)
    marker = tmp_path / "written-by-the-job.db"  # tmp_path is 0700: nobody cannot write there
    request = {
        "argv": ["pipeline", "init-tracking", "--tracking-uri", f"sqlite:///{marker}"],
        "cwd": "/",
        "env": env,
        "rpb": identity(),
    }
    try:
        deadline = time.monotonic() + 60
        while _connect(path) is None:
            assert server.poll() is None and time.monotonic() < deadline, "no server started"
            time.sleep(0.1)
        # 1. The directory: nobody cannot even reach the socket.
        assert _as(NOBODY, path, request) == "connect: PermissionError"
        assert not marker.exists()
        # 2. Past the directory: the server refuses nobody's connection (here probably while it
        #    still imports the libraries, so its acknowledging thread refuses it).
        past_the_directory = _can_switch(dac_override=True)
        if past_the_directory:
            assert _as(NOBODY, path, request, dac_override=True).startswith("refused: ")
            assert not marker.exists()
        # 3. The owner's identical request runs.
        answer = _as(None, path, request)
        assert re.fullmatch(r"answer: \[('queued', )?'send', '\d+', '0'\]", answer), answer
        assert marker.is_file()
        marker.unlink()
        # 4. Again past the directory, now that the server forks jobs from its main loop.
        if past_the_directory:
            assert _as(NOBODY, path, request, dac_override=True).startswith("refused: ")
            assert not marker.exists()
            log = Path(path + ".log").read_text()
            assert log.count(f"refused a connection from uid {NOBODY}") == 2, log
        else:
            pytest.skip("no CAP_DAC_OVERRIDE to give uid 65534: peer-credential check not run")
    finally:
        _stop(server.pid)
        server.wait(timeout=60)


@pytest.mark.slow  # end to end: client and server processes, a job run through them
def test_a_silent_server_costs_one_line_and_seconds(tmp_path: Path, sockets: Path) -> None:
    """A socket that takes connections and never answers: the client says so in one line and
    runs the job itself, within ANSWER_TIMEOUT (not the former 120 s)."""
    key = f"test-{tmp_path}"
    env = _env(key, sockets)
    path = address(key)
    store = tmp_path / "mlflow.db"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(8)  # connections queue and are never accepted, nor answered
        start = time.monotonic()
        proc = subprocess.Popen(
            [
                *_client(tmp_path),
                "pipeline",
                "init-tracking",
                "--tracking-uri",
                f"sqlite:///{store}",
            ],
            cwd=tmp_path,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = proc.stderr.readline()
        said = time.monotonic() - start
        rest = first + proc.communicate(timeout=600)[1]
    assert first == (
        f"{FALLBACK}no answer from {path} within 5 s; running the job in this process\n"
    ), rest
    assert said < 10, said
    assert [line for line in rest.splitlines() if "job server" in line] == [first.strip()]
    assert proc.returncode == 0 and store.is_file(), rest  # the job ran in the client


def test_an_unsafe_socket_directory_is_refused_in_one_line(
    tmp_path: Path, sockets: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(SERVER_ENV, f"test-{tmp_path}")
    cases = {"open": (0o755, "is open to other users (mode 0755, needs 0700)")}
    if os.geteuid() == 0:
        cases["foreign"] = (0o700, f"is owned by uid {NOBODY}, not by this user (0)")
    for name, (mode, message) in cases.items():
        unsafe = sockets / name
        unsafe.mkdir(mode=mode)
        unsafe.chmod(mode)  # past the umask
        if name == "foreign":
            os.chown(unsafe, NOBODY, NOBODY)
        monkeypatch.setenv(DIR_ENV, str(unsafe))
        assert run_via_server(["pipeline", "init-tracking"]) is None  # the caller runs the job
        err = capsys.readouterr().err
        assert err == f"{FALLBACK}{unsafe} {message}; running the job in this process\n"
        assert list(unsafe.iterdir()) == []  # no server started, no socket made
    link = sockets / "link"
    link.symlink_to(sockets)
    monkeypatch.setenv(DIR_ENV, str(link))
    assert run_via_server(["pipeline", "init-tracking"]) is None
    assert capsys.readouterr().err == (
        f"{FALLBACK}{link} is not a directory; running the job in this process\n"
    )


def test_the_address_depends_on_user_key_and_interpreter_not_on_the_rpb_copy(
    tmp_path: Path, sockets: Path
) -> None:
    """A copied checkout with edited sources computes the same address (the server it finds
    checks the copy per request instead); another key or interpreter path gives another."""
    first, second = address("a"), address("b")
    assert first != second and first == address("a")
    assert Path(first).parent == sockets and first.endswith(".sock")
    info = os.stat(sockets)
    assert info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "rpb", copy / "rpb", ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "rpb" / "pipeline" / "jobserver.py").open("a") as f:
        f.write("# edited\n")
    show = (
        "import sys, rpb.pipeline.jobserver as j; print(j.address('a'), j.__file__, j.identity())"
    )
    env = dict(os.environ, PYTHONPATH=str(copy))
    python = tmp_path / "python"
    python.symlink_to(sys.executable)
    runs = {
        exe: subprocess.run(
            [exe, "-c", show], cwd=copy, env=env, capture_output=True, text=True, check=True
        ).stdout.split(" ", 2)
        for exe in (sys.executable, str(python))
    }
    got, where, who = runs[sys.executable]
    assert got == first and where.startswith(str(copy))  # another copy, the same address
    assert who.strip() != str(identity())  # which the server would tell apart
    assert runs[str(python)][0] != first  # another interpreter path: another server


def test_the_client_reads_answers_that_arrive_together() -> None:
    """`queued` and `send`, or a fast job's pid and status, can come in one read."""
    here, there = socket.socketpair()
    with here, there:
        there.sendall(b"queued\nsend\n4242\n")
        lines = jobserver._Lines(here, "test")
        assert [lines.next(1.0) for _ in range(3)] == ["queued", "send", "4242"]
        there.sendall(b"0")
        there.shutdown(socket.SHUT_WR)
        with pytest.raises(jobserver.Unavailable, match=r"^test dropped the job"):
            lines.next(1.0)


# A server (its own process) whose job writes its pid and that of a `sleep` it starts, then sleeps:
# nothing imported (no PRELOAD, a stand-in torch), so it serves within a second.
SLEEPY_SERVER = """
import os, subprocess, sys, time, types
sys.modules["torch"] = types.SimpleNamespace(set_num_threads=lambda n: None)
from rpb.pipeline import jobserver
jobserver.PRELOAD = ()

def job(argv):
    grandchild = subprocess.Popen(["sleep", "60"])
    open(argv[0] + ".tmp", "w").write(f"{os.getpid()} {grandchild.pid}")
    os.replace(argv[0] + ".tmp", argv[0])
    time.sleep(60)
    return 0

jobserver.serve("sleepy", sys.argv[1], job=job)
"""


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def test_a_job_dies_with_its_sigkilled_client(tmp_path: Path, sockets: Path) -> None:
    """Issue 47 (item 2). Before: after SIGKILL of Snakemake's process group the clients died but
    the server's forks ran on (4.5 s after the results lock was released), and the recovery
    started the same jobs beside them. Now the server sees the client's connection close and
    kills the job's process group, what it started included, within its 50 ms loop."""
    path = str(sockets / "sleepy.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RPB_JOB_SERVER_IDLE="30")
    server = subprocess.Popen([sys.executable, "-c", SLEEPY_SERVER, path], env=env)
    client, left = None, []
    try:
        for _ in range(200):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        marker = tmp_path / "pids"
        code = f"from rpb.pipeline import jobserver; jobserver._submit('sleepy', {path!r}, "
        code += f"[{str(marker)!r}])"
        client = subprocess.Popen([sys.executable, "-c", code], env=env)
        for _ in range(400):
            if marker.exists():
                break
            time.sleep(0.05)
        job, grandchild = left = [int(pid) for pid in marker.read_text().split()]
        client.kill()
        client.wait()
        killed = time.monotonic()
        while not (_gone(job) and _gone(grandchild)) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        took = time.monotonic() - killed
        assert _gone(job) and _gone(grandchild), "the job outlived its client by 5 s"
        assert took < 1.0, took
        assert server.poll() is None  # the server itself serves on
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        for pid in left:  # what a failing run leaves
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()
