"""A throwaway PostgreSQL server for tests and benchmarks: Debian's binaries, ``initdb``
+ ``pg_ctl`` in a temporary directory, a loopback TCP port, run as an unprivileged user.

PostgreSQL refuses to run as root (we run as root), so the cluster belongs to the
``postgres`` user Debian's package creates, or to ``corral-pg`` (created with
``useradd`` when neither exists). The port is chosen at random and the server started
on it; if another process holds it, the start fails and another port is tried (the
server binding the port is the only check: no probe-then-bind race).

Invariants:
- The server's pid is read from ``postmaster.pid`` and ``stop`` kills exactly that
  process (SIGTERM via ``pg_ctl stop -m immediate``, then SIGKILL by pid) and removes
  the directory.
- Password authentication on TCP (scram-sha-256): the URLs carry a password, so tests
  can check that none leaks into a message.
- Durability is off by default (``fsync=off``): the tests check commit semantics and
  crashes of Corral processes, not the server's own crash safety; the benchmarks start
  it with ``durable=True`` (fsync on, the defaults of a production server).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SUPERUSER = "corral"
_USERS = ("postgres", "corral-pg")


def find_bindir() -> Path | None:
    """Debian's PostgreSQL binaries (the newest installed major version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


def unprivileged_user() -> pwd.struct_passwd:
    for name in _USERS:
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    _USERS[-1]], check=True, capture_output=True, timeout=30)
    return pwd.getpwnam(_USERS[-1])


@dataclass
class PgServer:
    bindir: Path
    root: Path
    user: pwd.struct_passwd
    password: str
    port: int = 0
    pid: int | None = None
    durable: bool = False

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", self.user.pw_name, "--", *argv],
                              capture_output=True, text=True, timeout=timeout_s, cwd="/")

    @classmethod
    def start(cls, *, tries: int = 8, durable: bool = False) -> PgServer:
        bindir = find_bindir()
        if bindir is None:
            raise FileNotFoundError("no /usr/lib/postgresql/*/bin/initdb")
        user = unprivileged_user()
        root = Path(tempfile.mkdtemp(prefix="corral-pg-", dir="/tmp"))
        os.chown(root, user.pw_uid, user.pw_gid)
        server = cls(bindir, root, user, secrets.token_urlsafe(12), durable=durable)
        try:
            server._initdb()
            for _ in range(tries):
                server.port = random.randint(20_000, 59_999)
                if server._pg_ctl_start():
                    return server
            raise RuntimeError(f"PostgreSQL did not start on any of {tries} ports; see "
                               f"{root / 'server.log'}")
        except BaseException:
            server.stop()
            raise

    def _initdb(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password)
        os.chown(pwfile, self.user.pw_uid, self.user.pw_gid)
        out = self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                        "--pwfile", str(pwfile), "--auth-local=trust",
                        "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                        "--no-sync")
        pwfile.unlink()
        if out.returncode != 0:
            raise RuntimeError(f"initdb failed: {out.stderr.strip()[-400:]}")

    def _pg_ctl_start(self) -> bool:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
                   "-c max_connections=200 -c shared_buffers=32MB")
        if not self.durable:
            options += " -c fsync=off -c full_page_writes=off"
        out = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                        str(self.root / "server.log"), "-o", options, "-w", "-t", "60",
                        "start")
        if out.returncode == 0:
            self.pid = self._postmaster_pid()
            return True
        return False

    def _postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        return None

    def restart(self) -> None:
        """Stop the server at once and start it again on the same port."""
        self.kill()
        if not self._pg_ctl_start():
            raise RuntimeError(f"PostgreSQL did not restart on port {self.port}")

    def kill(self) -> None:
        """Stop the server (immediate: like a crash, no checkpoint) and reap it by pid."""
        pid = self.pid or self._postmaster_pid()
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGQUIT)  # PostgreSQL's "immediate shutdown"
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
        if _alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.pid = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def psql(self, sql: str, database: str = "postgres") -> str:
        out = self._run(str(self.bindir / "psql"), "-h", str(self.root), "-p", str(self.port),
                        "-U", SUPERUSER, "-d", database, "-XAtq", "-v", "ON_ERROR_STOP=1",
                        "-c", sql)
        if out.returncode != 0:
            raise RuntimeError(f"psql {sql!r}: {out.stderr.strip()}")
        return out.stdout

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        name = "t_" + secrets.token_hex(6)
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[-1]
        with contextlib.suppress(RuntimeError):
            self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours (pg_ctl's child is re-parented, but be safe).
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as fh:
        if fh.read().split(") ", 1)[1].startswith("Z"):
            return False
    return True
