"""Key management of a farm: where its CURVE keys live and how keys are allowed in.

Layout under the farm's home (all created by ``corral keys init``)::

    HOME/keys/broker.key          the broker's public key: give it to workers/supervisors
    HOME/keys/broker.key_secret   the broker's key pair (0600)
    HOME/keys/supervisor.key      the supervisor's public key: give it to clients
    HOME/keys/supervisor.key_secret
    HOME/keys/allowed/NAME.key    the allow-list: public keys with a role (and tenant)

The supervisor's own key is on the allow-list with role ``supervisor`` (it is
the broker's client). Remote workers get role ``worker``; clients of the
supervisor role ``client``, optionally bound to a tenant.

Invariants:
- Secret files are created with mode 0600 and never overwritten.
- The allow-list only ever holds public keys: ``allow`` copies only the
  public key out of whatever file it is given (even a ``.key_secret``).

Errors: ``broker.security.KeyFileError`` (a ValueError) with a message that
says what to do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from broker.security import (
    NAME_RE,
    CurveClient,
    CurveServer,
    KeyFileError,
    read_key_file,
    write_allowed,
    write_key_pair,
)

__all__ = ["FarmKeys", "KeyFileError", "allow", "ensure_farm_keys", "farm_keys", "new_key"]


@dataclass(frozen=True, slots=True)
class FarmKeys:
    home: Path

    @property
    def directory(self) -> Path:
        return self.home / "keys"

    @property
    def allow_dir(self) -> Path:
        return self.directory / "allowed"

    def public(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.directory / f"{name}.key_secret"

    def supervisor_server(self) -> CurveServer:
        return CurveServer.from_files(self.secret("supervisor"), self.allow_dir)

    def supervisor_as_client(self) -> CurveClient:
        """The supervisor's credentials towards the broker's tcp:// frontend."""
        return CurveClient.from_files(self.public("broker"), self.secret("supervisor"))

    def exists(self) -> bool:
        return self.secret("broker").exists() and self.secret("supervisor").exists()


def farm_keys(home: Path) -> FarmKeys:
    return FarmKeys(home)


def new_key(name: str, directory: Path) -> tuple[Path, Path]:
    """``corral keys new``: a key pair NAME.key / NAME.key_secret in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    return write_key_pair(directory, name)


def allow(file: Path, home: Path, *, role: str, tenant: str | None = None,
          name: str | None = None) -> Path:
    """``corral keys allow``: put the public key of ``file`` on the farm's allow-list."""
    kf = read_key_file(file)
    stem = name or file.name.split(".key")[0]
    if not NAME_RE.match(stem):
        raise KeyFileError(f"cannot name the key {stem!r}; pass --name NAME "
                           f"({NAME_RE.pattern})")
    return write_allowed(farm_keys(home).allow_dir, stem, kf.public, role=role, tenant=tenant)


def ensure_farm_keys(home: Path) -> FarmKeys:
    """``corral keys init``: the broker's and supervisor's key pairs, once; the
    supervisor allowed at the broker. Idempotent."""
    fk = farm_keys(home)
    fk.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(fk.directory, 0o700)
    for name in ("broker", "supervisor"):
        if not fk.secret(name).exists():
            write_key_pair(fk.directory, name)
    fk.allow_dir.mkdir(exist_ok=True)
    if not (fk.allow_dir / "supervisor.key").exists():
        allow(fk.public("supervisor"), home, role="supervisor")
    return fk
