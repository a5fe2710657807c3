"""Store URLs: which store a farm uses, checked, and shown without secrets.

``[store] url`` in corral.toml (or ``--store-url``) names a PostgreSQL database:
``postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME[?PARAMS]`` (``postgres://`` too). No
URL means the embedded SQLite file ``HOME/corral.db``.

Invariants:
- ``redact`` never returns a password: the one in the netloc and any ``password=``
  query parameter become ``***``. Every message and log line naming a store URL uses it.
- ``check_url`` raises ``BadStoreUrl`` (a ``ValueError``) with the redacted URL only.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SCHEMES = ("postgresql", "postgres")
_HIDDEN = "***"


class BadStoreUrl(ValueError):
    """The store URL is not one Corral can use; the message says why (without secrets)."""


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (never raises)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{_HIDDEN}@{hostport}" if colon else f"{user}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, _HIDDEN if k.lower() == "password" else v) for k, v in pairs],
                          safe="*/:")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's message) without ``url`` (shown redacted) or its password."""
    text = text.replace(url, redact(url))
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def check_url(url: object) -> str:
    """Return ``url`` if it names a PostgreSQL database, else raise ``BadStoreUrl``."""
    if not isinstance(url, str) or not url.strip():
        raise BadStoreUrl("the store url must be a non-empty string")
    shown = redact(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BadStoreUrl(f"{shown}: not a valid URL ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise BadStoreUrl(f"{shown}: the store url must start with postgresql:// "
                          "(leave [store] out for the embedded SQLite store)")
    if not parts.hostname and "host=" not in parts.query:
        raise BadStoreUrl(f"{shown}: names no host (postgresql://USER@HOST:PORT/DBNAME)")
    if port == 0:
        raise BadStoreUrl(f"{shown}: port 0 is not a port")
    if not parts.path.strip("/"):
        raise BadStoreUrl(f"{shown}: names no database (postgresql://USER@HOST:PORT/DBNAME)")
    if any(c in url for c in "\x00\r\n"):
        raise BadStoreUrl(f"{shown}: holds a control character")
    return url
