"""Temporary servers on 127.0.0.1 for the side-by-side benchmark: beanstalkd, redis-server, PostgreSQL and
the broker, each in its own temporary directory, each stopped by its PID when the ``with`` block ends
(also on an exception or Ctrl-C).

Missing servers are installed from Debian's packages (``apt-get install -y beanstalkd redis-server
postgresql``) when this runs as root on a machine that has apt-get. PostgreSQL refuses to run as root:
as root, ``initdb`` and ``postgres`` run as the unprivileged user ``nobody`` (``subprocess.Popen(user=)``),
in a temporary directory handed to that user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.server import HOST, BenchError, running_server

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
INSTALL_TIMEOUT = 600.0
#: Who runs PostgreSQL when this process is root.
POSTGRES_USER = "nobody"
#: Debian's package for each server binary this module needs.
PACKAGES = {"beanstalkd": "beanstalkd", "redis-server": "redis-server", "postgres": "postgresql"}
#: Where Debian installs each major version of PostgreSQL (``*`` is the version: 9.6, 15, ...).
POSTGRES_INSTALLS = "/usr/lib/postgresql/*/bin"


@dataclass
class Instance:
    """One running server: its PID (the one whose process tree is measured and stopped) and the address
    the clients need, as a plain dict (it is handed to forked client processes)."""

    system: str
    pid: int
    address: dict[str, Any]
    command: list[str]
    settings: dict[str, Any] = field(default_factory=dict)


# -- processes -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``, the children it has reaped, and its live descendants: a
    PostgreSQL server is a postmaster plus one backend per connection and a few helpers."""
    clock_ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    ticks: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = (int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))
    if pid not in ticks:
        raise BenchError(f"process {pid} is gone")
    total = sum(ticks[pid])
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent:
                total += sum(ticks[child])
                frontier.append(child)
    return total / clock_ticks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(process: subprocess.Popen[bytes], first_signal: int = signal.SIGTERM) -> None:
    """``first_signal``, then SIGKILL if it is still there after ``STOP_TIMEOUT``; always reaped."""
    if process.poll() is not None:
        return
    process.send_signal(first_signal)
    try:
        process.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_for_port(process: subprocess.Popen[bytes], port: int, log_path: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"{what} exited {process.returncode}: {_tail(log_path)}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1.0):
            return
        time.sleep(0.05)
    raise BenchError(f"{what} did not listen on {HOST}:{port} within {START_TIMEOUT:g} s: {_tail(log_path)}")


def _tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-500:]
    except OSError:
        return "(no log)"


# -- finding and installing binaries ---------------------------------------------------------------------


def _postgres_bin_dir() -> Path | None:
    """The directory holding ``postgres`` and ``initdb``: beside ``pg_ctl`` on the PATH (followed through
    its symlink, e.g. /usr/local/bin/pg_ctl → /usr/lib/postgresql/15/bin), or Debian's newest."""
    pg_ctl = shutil.which("pg_ctl")
    candidates = [Path(pg_ctl).resolve().parent] if pg_ctl else []
    installs = [Path(path) for path in glob.glob(POSTGRES_INSTALLS)]
    candidates += sorted(installs, key=lambda directory: _version_key(directory.parent.name), reverse=True)
    for directory in candidates:
        if (directory / "postgres").exists() and (directory / "initdb").exists():
            return directory
    return None


def _version_key(version: str) -> tuple[int, ...]:
    """``"9.6"`` → ``(9, 6)``, so that 15 sorts above 9.6 (as text, "9.6" > "15"); a part that is not a
    number counts as -1."""
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("."))


def _binary(name: str) -> str | None:
    if name == "postgres":
        directory = _postgres_bin_dir()
        return str(directory / "postgres") if directory else None
    return shutil.which(name)


def ensure_installed(names: list[str]) -> dict[str, str]:
    """The path of each server binary, installing the missing ones with apt-get (as root only)."""
    missing = [name for name in names if _binary(name) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise BenchError(f"not installed: {', '.join(missing)} (install Debian's {_packages(missing)})")
        command = ["apt-get", "install", "-y", "--no-install-recommends", *_packages(missing).split()]
        environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        done = subprocess.run(command, capture_output=True, timeout=INSTALL_TIMEOUT, env=environment)
        if done.returncode != 0:  # perhaps a stale package list: update it once and try again
            subprocess.run(
                ["apt-get", "update"], capture_output=True, timeout=INSTALL_TIMEOUT, env=environment
            )
            done = subprocess.run(command, capture_output=True, timeout=INSTALL_TIMEOUT, env=environment)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(command)} failed: {done.stderr.decode(errors='replace')[-300:]}")
    paths = {name: _binary(name) for name in names}
    still_missing = [name for name, path in paths.items() if path is None]
    if still_missing:
        raise BenchError(f"still not installed: {', '.join(still_missing)}")
    return {name: path for name, path in paths.items() if path is not None}


def _packages(names: list[str]) -> str:
    return " ".join(PACKAGES[name] for name in names)


def version(binary: str) -> str:
    flag = "-v" if Path(binary).name == "beanstalkd" else "--version"
    done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=10)
    return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else "?"


# -- the servers -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def beanstalkd(binary: str, durable: bool) -> Iterator[Instance]:
    """``beanstalkd -l 127.0.0.1 -p PORT``, plus ``-b DIR -f 0`` (a binlog, fsynced after every write)
    when ``durable``; without ``-b`` it keeps nothing on disk."""
    with tempfile.TemporaryDirectory(prefix="peers-beanstalkd-") as tmp:
        port = free_port()
        command = [binary, "-l", HOST, "-p", str(port)]
        if durable:
            (Path(tmp) / "binlog").mkdir()
            command += ["-b", str(Path(tmp) / "binlog"), "-f", "0"]
        with _process(command, Path(tmp), port, "beanstalkd") as process:
            yield Instance("beanstalkd", process.pid, {"host": HOST, "port": port}, command)


@contextlib.contextmanager
def redis(binary: str, durable: bool) -> Iterator[Instance]:
    """``redis-server`` with no config file (so the compiled-in defaults: RDB snapshots with ``save 3600 1
    300 100 60 10000``, no AOF) on 127.0.0.1, in a temporary ``--dir``; when ``durable``, also
    ``--appendonly yes --appendfsync always`` (the AOF written and fsynced before each reply)."""
    with tempfile.TemporaryDirectory(prefix="peers-redis-") as tmp:
        port = free_port()
        command = [binary, "--bind", HOST, "--port", str(port), "--dir", tmp, "--daemonize", "no"]
        if durable:
            command += ["--appendonly", "yes", "--appendfsync", "always"]
        with _process(command, Path(tmp), port, "redis-server") as process:
            yield Instance("redis", process.pid, {"host": HOST, "port": port}, command)


@contextlib.contextmanager
def _process(
    command: list[str], tmp: Path, port: int, what: str, **popen: Any
) -> Iterator[subprocess.Popen[bytes]]:
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=tmp, **popen
        )
    try:
        _wait_for_port(process, port, log_path, what)
        yield process
    finally:
        stop_pid(process)


#: Settings every PostgreSQL instance gets, durable or not (``-c name=value``).
POSTGRES_COMMON = {
    "listen_addresses": HOST,
    "fsync": "on",
    "full_page_writes": "on",
    "max_connections": "50",
    "shared_buffers": "128MB",  # the default, stated
}
#: The one setting that differs: ``on`` waits for the WAL flush before a commit returns.
POSTGRES_MODES = {True: {"synchronous_commit": "on"}, False: {"synchronous_commit": "off"}}


class PostgresTemplate:
    """One ``initdb`` per benchmark run, copied for each instance (a fresh cluster in ~0.2 s)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self._tmp = tempfile.TemporaryDirectory(prefix="peers-pg-template-")
        self.data = Path(self._tmp.name) / "data"
        self._user = _postgres_user()
        _hand_over(Path(self._tmp.name), self._user)
        done = subprocess.run(
            [
                str(bin_dir / "initdb"), "-D", str(self.data), "-U", "bench", "--auth=trust",
                "--encoding=UTF8", "--locale=C", "--no-sync",
            ],
            capture_output=True, timeout=START_TIMEOUT, cwd=self._tmp.name, **_as_user(self._user),
        )  # fmt: skip
        if done.returncode != 0:
            self.close()
            raise BenchError(f"initdb failed: {done.stderr.decode(errors='replace')[-500:]}")

    def close(self) -> None:
        self._tmp.cleanup()


def _postgres_user() -> str | None:
    return POSTGRES_USER if os.geteuid() == 0 else None


def _as_user(user: str | None) -> dict[str, Any]:
    return {"user": user, "group": user and _group_of(user), "extra_groups": []} if user else {}


def _group_of(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_gid


def _hand_over(directory: Path, user: str | None) -> None:
    if user is None:
        return
    import pwd

    entry = pwd.getpwnam(user)
    for root, directories, files in os.walk(directory):
        for name in [*directories, *files]:
            os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)
    os.chown(directory, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def postgres(template: PostgresTemplate, durable: bool) -> Iterator[Instance]:
    """``postgres -D <copy of the template> -p PORT -k <tmp> -c ...`` run directly (not through pg_ctl, so
    that it is this process's child and is stopped by its PID: SIGINT, PostgreSQL's fast shutdown)."""
    with tempfile.TemporaryDirectory(prefix="peers-postgres-") as tmp:
        user = _postgres_user()
        data = Path(tmp) / "data"
        shutil.copytree(template.data, data, symlinks=True)
        _hand_over(Path(tmp), user)
        port = free_port()
        settings = {**POSTGRES_COMMON, **POSTGRES_MODES[durable]}
        command = [str(template.bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-k", tmp]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        log_path = Path(tmp) / "server.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=tmp, **_as_user(user)
            )
        try:
            _wait_for_port(process, port, log_path, "postgres")
            dsn = f"host={HOST} port={port} user=bench dbname=postgres"
            _wait_for_sql(dsn, process, log_path)
            yield Instance("postgres", process.pid, {"dsn": dsn}, command, settings)
        finally:
            stop_pid(process, signal.SIGINT)


def _wait_for_sql(dsn: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    import psycopg

    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=5) as connection:
                connection.execute("SELECT 1")
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise BenchError(f"postgres does not accept connections: {_tail(log_path)}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def broker(durable_server: bool) -> Iterator[Instance]:
    """``python -m broker serve`` (``bench.server.running_server``): journaling to a temporary data
    directory when ``durable_server``, else ``--in-memory``."""
    with running_server(durable=durable_server) as server:
        command = ["python", "-m", "broker", "serve", *([] if durable_server else ["--in-memory"])]
        yield Instance("broker", server.pid, {"host": server.host, "port": server.port}, command)
