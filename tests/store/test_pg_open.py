"""Choosing and opening the PostgreSQL store: ``[store] url`` is checked with typed
errors, an unreachable server is a clear error naming the URL without its password
(in the store and in a real ``python -m supervisor``), and the schema is created in an
empty database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor import config as config_mod
from supervisor.store import SessionId, StoreUnavailable
from supervisor.store.opening import open_for_home
from supervisor.store.pg.store import PgStore
from supervisor.store.url import redact
from tests.store.steps import Session, new_record, tool_round

SECRET = "s3cr3t-pw"
# Port 1 on loopback: nothing listens there, the connection is refused at once.
DEAD_URL = f"postgresql://corral:{SECRET}@127.0.0.1:1/corral"


def _write_config(home: Path, text: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "corral.toml").write_text(text)


def _supervisor_exits_2(home: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor`` on ``home`` (no broker needed: the store is opened
    first), which must refuse to start with exit status 2."""
    out = subprocess.run(
        [sys.executable, "-m", "supervisor", "--home", str(home), "--broker",
         f"ipc://{tmp_path}/nobroker.sock", "--listen", f"ipc://{tmp_path}/sv.sock"],
        capture_output=True, text=True, timeout=50)
    assert out.returncode == 2, out.stderr[-2000:]
    return out


@pytest.mark.parametrize(("value", "why"), [
    ('"sqlite:///x.db"', "must start with postgresql://"),
    ('"postgresql://corral@/corral"', "names no host"),
    ('"postgresql://corral@db:5432/"', "names no database"),
    ("5432", "must be a string"),
    (f'"postgresql://corral:{SECRET}@db:99999/x"', "not a valid URL"),
])
def test_a_bad_store_url_is_a_config_error_without_the_password(
    tmp_path: Path, value: str, why: str
) -> None:
    _write_config(tmp_path, f"[store]\nurl = {value}\n")
    with pytest.raises(config_mod.ConfigError, match=why) as info:
        config_mod.load(tmp_path)
    assert SECRET not in str(info.value)
    assert "[store.url]" in str(info.value)


def test_unknown_store_keys_and_the_default(tmp_path: Path) -> None:
    _write_config(tmp_path, '[store]\npath = "x"\n')
    with pytest.raises(config_mod.ConfigError, match=r"unknown key\(s\) \['path'\]"):
        config_mod.load(tmp_path)
    _write_config(tmp_path, "")
    assert config_mod.load(tmp_path).store_url is None
    _write_config(tmp_path, f'[store]\nurl = "{DEAD_URL}"\n')
    assert config_mod.load(tmp_path).store_url == DEAD_URL


def test_redact_hides_every_password_form() -> None:
    assert redact(DEAD_URL) == "postgresql://corral:***@127.0.0.1:1/corral"
    assert SECRET not in redact(f"postgresql://u@h/d?password={SECRET}&sslmode=require")
    assert redact("postgresql://u@h:5/d") == "postgresql://u@h:5/d"
    assert redact("postgresql://u:p%40ss@h/d?pass%77ord=x&sslpassword=y&a=b") \
        == "postgresql://u:***@h/d?pass%77ord=***&sslpassword=***&a=b"


# Texts a user may put in [store] url by mistake, each holding SECRET (or a piece of
# it) where a naive URL parser does not look for a password: a libpq keyword string,
# no scheme, one slash, and passwords with an unencoded '/', '#', '?' or '@'.
MISTAKES = [
    f"host=127.0.0.1 port=1 password={SECRET} dbname=corral",
    f"corral:{SECRET}@127.0.0.1:1/corral",
    f"postgresql:/corral:{SECRET}@127.0.0.1:1/corral",
    "postgresql://corral:s3c/r3t-pw@127.0.0.1:1/corral",
    "postgresql://corral:s3c#r3t-pw@127.0.0.1:1/corral",
    "postgresql://corral:s3c?r3t-pw@127.0.0.1:1/corral",
    "postgresql://corral:s3c@x/r3t-pw@127.0.0.1:1/corral",
    "postgresql://corral/s3cr3t-pw@127.0.0.1:1/corral",
    "postgresql://corral:s3cr3t-pw@[::1/corral",
]


@pytest.mark.parametrize("url", MISTAKES)
def test_a_mistyped_store_url_never_shows_its_password(tmp_path: Path, url: str) -> None:
    assert "r3t-pw" not in redact(url)
    _write_config(tmp_path, f"[store]\nurl = '{url}'\n")
    with pytest.raises(config_mod.ConfigError) as info:
        config_mod.load(tmp_path)
    assert "r3t-pw" not in str(info.value), info.value


@pytest.mark.timeout(30)
async def test_unreachable_postgresql_names_the_url_without_the_password() -> None:
    with pytest.raises(StoreUnavailable) as info:
        await PgStore.open(DEAD_URL, connect_timeout_s=5.0)
    message = str(info.value)
    assert "postgresql://corral:***@127.0.0.1:1/corral" in message
    assert SECRET not in message
    assert info.value.retryable


@pytest.mark.timeout(60)
def test_a_supervisor_with_an_unreachable_store_exits_with_that_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _write_config(home, f'[store]\nurl = "{DEAD_URL}"\n')
    out = _supervisor_exits_2(home, tmp_path)
    assert "cannot connect to PostgreSQL at postgresql://corral:***@127.0.0.1:1/corral" \
        in out.stderr
    assert SECRET not in out.stderr + out.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("url", [MISTAKES[0], MISTAKES[3], MISTAKES[6]])
def test_corral_up_with_a_mistyped_store_url_shows_no_password(tmp_path: Path,
                                                               url: str) -> None:
    """The real CLI: ``corral up`` refuses the farm with the config error, and neither its
    output nor any file it wrote holds the password."""
    home = tmp_path / "home"
    _write_config(home, f"[store]\nurl = '{url}'\n")
    out = subprocess.run([sys.executable, "-m", "supervisor.cli", "up", "--home", str(home),
                          "--detach", "--workers", "0"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "[store.url]" in out.stderr
    assert "r3t-pw" not in out.stdout + out.stderr
    for path in home.rglob("*"):
        if path.is_file() and path.name != "corral.toml":
            assert "r3t-pw" not in path.read_text(errors="replace"), path


@pytest.mark.timeout(60)
async def test_an_empty_database_gets_the_schema_and_the_home_config_picks_it(
    pg_server: Any, tmp_path: Path
) -> None:
    url = pg_server.new_database()
    try:
        _write_config(tmp_path, f'[store]\nurl = "{url}"\n')
        store = await open_for_home(tmp_path)
        try:
            assert isinstance(store, PgStore)
            assert pg_server.password not in store.where
            s = Session("s1")
            await store.create_session(new_record("s1"))
            await store.commit(s.step(tool_round(1), events=[("a", {})]))
        finally:
            await store.close()
        assert not (tmp_path / "corral.db").exists()  # nothing went to SQLite
        again = await open_for_home(tmp_path)
        try:
            loaded = await again.load(SessionId("s1"))
            assert loaded is not None
            assert loaded.context == tool_round(1)
        finally:
            await again.close()
    finally:
        pg_server.drop_database(url)


@pytest.mark.timeout(90)
def test_a_database_of_another_application_is_refused_clearly(pg_server: Any,
                                                              tmp_path: Path) -> None:
    """A database with no Corral schema but a table of one of its names (another
    application's ``sessions``): ``python -m supervisor`` exits 2 naming the problem and
    what to do, ``corral store migrate`` exits 1 the same, neither shows the password
    and the other application's table is left as it was. (The supervisor once died on a
    Python traceback, exit 1: DuplicateTable.)"""
    url = pg_server.new_database()
    name = url.rsplit("/", 1)[-1]
    pg_server.psql("CREATE TABLE sessions (id int); INSERT INTO sessions VALUES (7)", name)
    try:
        home = tmp_path / "home"
        _write_config(home, f'[store]\nurl = "{url}"\n')
        out = _supervisor_exits_2(home, tmp_path)
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "holds no Corral schema" in out.stderr
        assert "(sessions)" in out.stderr
        assert "CREATE DATABASE" in out.stderr
        migrate = subprocess.run([sys.executable, "-m", "supervisor.cli", "store", "migrate",
                                  "--home", str(home)], capture_output=True, text=True,
                                 timeout=60)
        assert migrate.returncode == 1, migrate.stderr
        assert "holds no Corral schema" in migrate.stderr
        for text in (out.stderr, out.stdout, migrate.stderr, migrate.stdout):
            assert pg_server.password not in text
        assert pg_server.psql("SELECT id FROM sessions", name).strip() == "7"
        assert pg_server.psql("SELECT to_regclass('schema_version') IS NULL", name).strip() \
            == "t"
    finally:
        pg_server.drop_database(url)


@pytest.mark.timeout(90)
def test_a_role_without_the_privilege_is_refused_clearly(pg_server: Any,
                                                         tmp_path: Path) -> None:
    """The URL's role may not create tables in the database: the supervisor exits 2 with
    the URL (password hidden, here percent-encoded in the URL) and what to grant, not a
    traceback (exit 1, before: only StoreUnavailable and schema errors were caught)."""
    url = pg_server.new_database()
    name = url.rsplit("/", 1)[-1]
    role, password = f"r_{name}", "pw@x/y:z"
    pg_server.psql(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    pg_server.psql("REVOKE CREATE ON SCHEMA public FROM PUBLIC", name)
    try:
        home = tmp_path / "home"
        weak = url.replace(f"corral:{pg_server.password}@",
                           f"{role}:{password.replace('@', '%40').replace('/', '%2F')}@")
        _write_config(home, f'[store]\nurl = "{weak}"\n')
        out = _supervisor_exits_2(home, tmp_path)
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
        assert f"{role}:***@" in out.stderr
        assert "lacks a privilege" in out.stderr
        assert "pw@x" not in out.stderr
        assert "pw%40x" not in out.stderr
    finally:
        pg_server.drop_database(url)
        pg_server.psql(f"DROP ROLE IF EXISTS {role}")


@pytest.mark.timeout(60)
async def test_a_failover_list_of_hosts_is_a_store_url(pg_server: Any, tmp_path: Path) -> None:
    """libpq's several hosts (``HOST1:PORT1,HOST2:PORT2``, how a Patroni or managed
    cluster is named) are accepted and used: the first refuses, the second serves. Such
    a URL was refused as 'not a valid URL' (urllib reads one port only)."""
    url = pg_server.new_database()
    try:
        several = url.replace("@127.0.0.1:", "@127.0.0.1:1,127.0.0.1:", 1)
        assert "127.0.0.1:1,127.0.0.1:" in several
        _write_config(tmp_path, f'[store]\nurl = "{several}?connect_timeout=5"\n')
        assert config_mod.load(tmp_path).store_url is not None
        store = await open_for_home(tmp_path)
        try:
            await store.create_session(new_record("s-failover"))
            assert await store.get_session(SessionId("s-failover")) is not None
            assert pg_server.password not in store.where
        finally:
            await store.close()
    finally:
        pg_server.drop_database(url)
