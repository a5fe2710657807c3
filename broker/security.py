"""CURVE encryption and ZAP authentication for Corral's TCP endpoints.

Pieces, from the files up:
- Key files in ZeroMQ's certificate format (``zmq.auth.load_certificate``
  reads them): ``NAME.key`` holds the public key, ``NAME.key_secret`` both
  keys (mode 0600). A public key file may carry ``metadata`` lines
  ``role = "worker"`` and ``tenant = "acme"``.
- ``AllowList``: a directory of public key files. It is re-read when the
  directory's mtime changes (checked on every handshake: handshakes are once
  per connection) and on ``reload()`` (SIGHUP), so keys are added and removed
  without a restart. A removed key stops *new* connections; a connection that
  is already authenticated lives on until it drops.
- ``ZapHandler``: the pure ZAP (RFC 27) decision: a CURVE client is accepted
  only if its public key is on the allow-list with a role the endpoint's
  domain admits (``backend``: workers; ``frontend``: supervisors; ``clients``:
  clients). The ZAP ``User-Id`` is ``NAME`` or ``NAME@TENANT``, fixed for
  the connection, so a message's tenant cannot change under it.
- ``Guard``: binds the ZAP socket (``inproc://zeromq.zap.01``) in one
  context and monitors each CURVE socket for handshake failures. Its sockets
  are served either by the broker's own poll loop (``poll_sockets`` +
  ``on_ready``) or, in asyncio processes, by ``Guard.run()``.

Why a ZAP socket in the broker's poll loop rather than pyzmq's
``ThreadAuthenticator``: the broker is one blocking thread; a handshake is one
small REP exchange, so serving it inline costs nothing, needs no lock around
the allow-list, and the whole broker stays one thread that stops with its loop.

Rejections (an unknown key, a plain-text peer, a wrong server key) never
affect other traffic: libzmq closes only that connection. Each is logged at
WARNING once per peer and reason (an unknown key: per address and key; the
monitor-reported failures carry no peer address in libzmq 4.3, so: once per
reason per ``REJECT_LOG_EVERY_S``), and counted in ``Guard.rejected``.

Errors: ``KeyFileError`` (a ``ValueError``) for an unreadable or malformed
key file; nothing else leaves this module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ROLES: Final = ("worker", "supervisor", "client")
# ZAP domain of each endpoint → the roles it admits.
DOMAINS: Final = {"backend": ("worker",), "frontend": ("supervisor",), "clients": ("client",)}
MAX_KEYS: Final = 10_000
MAX_KEY_FILE_BYTES: Final = 4096
REJECT_LOG_EVERY_S: Final = 10.0
MAX_REMEMBERED_REJECTS: Final = 4096
_FIELD = re.compile(r'^\s*([a-z-]+)\s*=\s*"([^"]*)"\s*$')
_MONITORED: Final = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# ZMQ_PROTOCOL_ERROR_ZMTP_* codes (zmq.h) that say what a failed peer did.
_PROTOCOL_REASONS: Final[dict[int, str]] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        "plain-text or other-mechanism peer on a CURVE endpoint",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        "cryptographic failure: the peer has the wrong server key",
    zmq.PROTOCOL_ERROR_ZMTP_UNEXPECTED_COMMAND: "peer sent an unexpected handshake command",
    zmq.PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_HELLO: "peer sent a malformed HELLO",
}


class KeyFileError(ValueError):
    """A key file is missing, unreadable or malformed."""


@dataclass(frozen=True, slots=True)
class KeyFile:
    public: bytes  # Z85, 40 bytes
    secret: bytes | None
    role: str | None = None
    tenant: str | None = None


def read_key_file(path: Path) -> KeyFile:
    """Parse a certificate file (public or secret)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from exc
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path} is not a key file (larger than {MAX_KEY_FILE_BYTES} bytes)")
    fields: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        m = _FIELD.match(line)
        if m:
            fields.setdefault(m.group(1), m.group(2))
    public = fields.get("public-key", "").encode()
    secret = fields.get("secret-key", "").encode() or None
    if len(public) != 40 or (secret is not None and len(secret) != 40):
        raise KeyFileError(f"{path} has no valid CURVE public-key (40 Z85 characters)")
    try:
        z85.decode(public)
        if secret is not None:
            z85.decode(secret)
    except ValueError as exc:
        raise KeyFileError(f"{path}: bad Z85 key: {exc}") from exc
    role = fields.get("role") or None
    if role is not None and role not in ROLES:
        raise KeyFileError(f"{path}: role {role!r} is not one of {ROLES}")
    tenant = fields.get("tenant") or None
    if tenant is not None and not NAME_RE.match(tenant):
        raise KeyFileError(f"{path}: tenant {tenant!r} must match {NAME_RE.pattern}")
    return KeyFile(public, secret, role, tenant)


def _certificate(public: bytes, secret: bytes | None, meta: dict[str, str]) -> str:
    lines = ["#   ZeroMQ CURVE " + ("**Secret** " if secret else "Public ") + "Certificate",
             "#   written by corral" + (": keep this file private (mode 0600)" if secret else ""),
             "", "metadata"]
    lines += [f'    {k} = "{v}"' for k, v in sorted(meta.items())]
    lines += ["curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (never briefly world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, mode)  # the umask may have narrowed it; never widened


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600); refuse to overwrite."""
    if not NAME_RE.match(name):
        raise KeyFileError(f"key name {name!r} must match {NAME_RE.pattern}")
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for p in (pub_path, sec_path):
        if p.exists():
            raise KeyFileError(f"{p} already exists; remove it first or pick another name")
    _write_new(sec_path, _certificate(public, secret, {}), 0o600)
    _write_new(pub_path, _certificate(public, None, {}), 0o644)
    return pub_path, sec_path


def write_allowed(allow_dir: Path, name: str, public: bytes, *, role: str,
                  tenant: str | None = None) -> Path:
    """Put one public key on the allow-list (atomically: tmp file + rename)."""
    if not NAME_RE.match(name):
        raise KeyFileError(f"key name {name!r} must match {NAME_RE.pattern}")
    if role not in ROLES:
        raise KeyFileError(f"role {role!r} is not one of {ROLES}")
    if tenant is not None and not NAME_RE.match(tenant):
        raise KeyFileError(f"tenant {tenant!r} must match {NAME_RE.pattern}")
    allow_dir.mkdir(parents=True, exist_ok=True)
    meta = {"role": role, **({"tenant": tenant} if tenant else {})}
    target = allow_dir / f"{name}.key"
    tmp = allow_dir / f".{name}.key.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    _write_new(tmp, _certificate(public, None, meta), 0o644)
    os.replace(tmp, target)
    return target


@dataclass(frozen=True, slots=True)
class Allowed:
    name: str
    role: str
    tenant: str | None


class AllowList:
    """Public keys allowed in, from a directory of ``*.key`` files (see module doc)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._keys: dict[bytes, Allowed] = {}
        self._stamp: tuple[int, int] | None = None
        self.reload()

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> None:
        keys: dict[bytes, Allowed] = {}
        try:
            st = self.directory.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
            paths = sorted(self.directory.glob("*.key"))[:MAX_KEYS]
        except OSError:
            stamp, paths = None, []
        for path in paths:
            try:
                kf = read_key_file(path)
            except KeyFileError as exc:
                log.warning("allow-list: skipping %s", exc)
                continue
            keys[kf.public] = Allowed(path.name[:-len(".key")], kf.role or "worker", kf.tenant)
        self._keys, self._stamp = keys, stamp
        log.info("allow-list %s: %d key(s)", self.directory, len(keys))

    def invalidate(self) -> None:
        self._stamp = None  # the next refresh() reloads

    def refresh(self) -> None:
        """Reload if the directory changed (a file added, removed or renamed in)."""
        try:
            st = self.directory.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None
        if stamp is None or stamp != self._stamp:
            self.reload()

    def lookup(self, public_z85: bytes) -> Allowed | None:
        return self._keys.get(public_z85)


def tenant_of_user_id(user_id: bytes) -> str | None:
    """The tenant in a ZAP User-Id ``NAME@TENANT`` (None without one)."""
    _, sep, tenant = user_id.decode("utf-8", "replace").partition("@")
    return tenant if sep and tenant else None


class ZapHandler:
    """The ZAP decision for one allow-list, and the once-per-peer rejection log."""

    def __init__(self, allow: AllowList) -> None:
        self.allow = allow
        self.accepted = 0
        self.rejected: collections.Counter[str] = collections.Counter()
        self._logged: collections.OrderedDict[tuple[str, ...], float] = (
            collections.OrderedDict())

    def reject_note(self, reason: str, *peer: str) -> None:
        """Count a rejection; log it once per (reason, peer) per REJECT_LOG_EVERY_S."""
        self.rejected[reason] += 1
        key = (reason, *peer)
        now = time.monotonic()
        last = self._logged.get(key)
        if last is not None and now - last < REJECT_LOG_EVERY_S:
            return
        self._logged[key] = now
        self._logged.move_to_end(key)
        while len(self._logged) > MAX_REMEMBERED_REJECTS:
            self._logged.popitem(last=False)
        log.warning("rejected connection: %s %s", reason, " ".join(peer))

    def handle(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP request (RFC 27 frames, after REP's envelope) → the reply frames."""
        if len(frames) < 6 or frames[0] != b"1.0":
            self.reject_note("malformed ZAP request")
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                    b"malformed ZAP request", b"", b""]
        request_id, domain, address = frames[1], frames[2], frames[3]
        mechanism = frames[5]
        addr = address.decode("utf-8", "replace")

        def deny(code: bytes, reason: str, *peer: str) -> list[bytes]:
            self.reject_note(reason, f"from {addr}", *peer)
            return [b"1.0", request_id, code, reason.encode(), b"", b""]

        if mechanism != b"CURVE" or len(frames) < 7 or len(frames[6]) != 32:
            return deny(b"400", f"mechanism {mechanism.decode('ascii', 'replace')} not allowed")
        public = z85.encode(frames[6])
        roles = DOMAINS.get(domain.decode("ascii", "replace"))
        if roles is None:
            return deny(b"400", f"unknown ZAP domain {domain!r}")
        self.allow.refresh()
        entry = self.allow.lookup(public)
        if entry is None:
            return deny(b"400", "unknown key (not on the allow-list)", f"key {public.decode()}")
        if entry.role not in roles:
            return deny(b"400", f"key {entry.name} has role {entry.role}, endpoint "
                        f"{domain.decode()} admits {'/'.join(roles)}", f"key {public.decode()}")
        self.accepted += 1
        user = entry.name + (f"@{entry.tenant}" if entry.tenant else "")
        log.info("accepted %s key %s from %s", entry.role, user, addr)
        return [b"1.0", request_id, b"200", b"OK", user.encode(), b""]


def recv_frames_user(sock: zmq.Socket[Any]) -> tuple[list[bytes], bytes]:
    """Like ``broker.transport.recv_frames`` (non-blocking; ``zmq.Again`` if nothing
    waits), plus the ZAP User-Id of the connection the message came on (``b""`` on
    a connection without one, e.g. plain ipc://)."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames: list[bytes] = [frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame.bytes)
    # Read it off a frame that came through the pipe (a ROUTER's identity frame
    # is made locally and carries no metadata).
    try:
        user = str(frame.get("User-Id")).encode()
    except zmq.ZMQError:  # no such property: not a ZAP-authenticated connection
        user = b""
    return frames, user


@dataclass(frozen=True, slots=True)
class CurveServer:
    """A server's key pair plus the allow-list its clients are checked against."""

    public: bytes
    secret: bytes
    allow_dir: Path

    @classmethod
    def from_files(cls, secret_file: Path, allow_dir: Path) -> CurveServer:
        kf = read_key_file(secret_file)
        if kf.secret is None:
            raise KeyFileError(f"{secret_file} holds no secret-key (use NAME.key_secret)")
        return cls(kf.public, kf.secret, allow_dir)


@dataclass(frozen=True, slots=True)
class CurveClient:
    """A client's key pair and the server's public key (``curve_serverkey``)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_key_file: Path, key_file: Path) -> CurveClient:
        server = read_key_file(server_key_file)
        own = read_key_file(key_file)
        if own.secret is None:
            raise KeyFileError(f"{key_file} holds no secret-key (use NAME.key_secret)")
        return cls(server.public, own.public, own.secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        """Configure a connecting socket (before ``connect``)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


class Guard:
    """The ZAP socket and handshake monitors of one context (see module doc)."""

    def __init__(self, ctx: zmq.Context[Any], server: CurveServer) -> None:
        self.server = server
        self.zap = ZapHandler(AllowList(server.allow_dir))
        self._ctx = ctx
        self._zap_sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self._zap_sock.setsockopt(zmq.LINGER, 0)
        self._zap_sock.bind(ZAP_ENDPOINT)
        self._monitors: dict[zmq.Socket[bytes], str] = {}
        self._secured: list[zmq.Socket[Any]] = []

    @property
    def rejected(self) -> collections.Counter[str]:
        return self.zap.rejected

    def reload(self) -> None:
        self.zap.allow.reload()

    def request_reload(self) -> None:
        """Re-read the allow-list at the next handshake (safe from a signal handler)."""
        self.zap.allow.invalidate()

    def secure(self, sock: zmq.Socket[Any], domain: str) -> None:
        """Make a bound socket a CURVE server in ZAP ``domain`` (before ``bind``)."""
        if domain not in DOMAINS:
            raise ValueError(f"domain must be one of {sorted(DOMAINS)}")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        if sock in self._secured:
            return  # already monitored (one monitor per socket)
        self._secured.append(sock)
        mon: zmq.Socket[bytes] = sock.get_monitor_socket(_MONITORED)
        mon.setsockopt(zmq.LINGER, 0)
        self._monitors[mon] = domain

    def poll_sockets(self) -> list[zmq.Socket[bytes]]:
        return [self._zap_sock, *self._monitors]

    def on_ready(self, sock: zmq.Socket[Any]) -> None:
        """Serve whatever is waiting on one of ``poll_sockets()`` (never blocks)."""
        if sock is self._zap_sock:
            self._serve_zap()
        elif sock in self._monitors:
            self._drain_monitor(sock, self._monitors[sock])

    def _serve_zap(self) -> None:
        for _ in range(64):
            try:
                frames = self._zap_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self.zap.handle(frames)
            except Exception:  # message boundary: answer "denied", never leave REP stuck
                log.exception("ZAP handler failed")
                reply = [b"1.0", frames[1] if len(frames) > 1 else b"", b"500",
                         b"internal error", b"", b""]
            self._zap_sock.send_multipart(reply, zmq.NOBLOCK)

    def _drain_monitor(self, mon: zmq.Socket[bytes], domain: str) -> None:
        for _ in range(64):
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)
            except Exception:  # a monitor frame we cannot parse: nothing to report
                continue
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                continue  # the ZAP handler already logged it, with the peer
            reason = _PROTOCOL_REASONS.get(value, f"handshake failed (code {value:#x})")
            self.zap.reject_note(reason, f"on {domain} endpoint")

    async def run(self) -> None:
        """Serve the guard's sockets from the running asyncio loop until cancelled."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        socks = self.poll_sockets()
        fds = [int(s.getsockopt(zmq.FD)) for s in socks]
        for fd in fds:
            loop.add_reader(fd, wake.set)
        try:
            while True:
                wake.clear()
                for s in socks:
                    # Edge-triggered fds: read EVENTS and drain until nothing is left.
                    while int(s.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        self.on_ready(s)
                await wake.wait()
        finally:
            for fd in fds:
                loop.remove_reader(fd)

    def close(self) -> None:
        for s in self._sock_list():
            s.close(linger=0)
        self._monitors.clear()
        self._secured.clear()

    def _sock_list(self) -> Iterable[zmq.Socket[Any]]:
        return [self._zap_sock, *self._monitors]
