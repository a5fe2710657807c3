"""Store URLs: which store a farm uses, checked, and shown without secrets.

``[store] url`` in corral.toml (or ``--store-url``) names a PostgreSQL database:
``postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME[?PARAMS]`` (``postgres://`` too). No
URL means the embedded SQLite file ``HOME/corral.db``.

Invariants:
- ``redact`` never returns a password, whatever the text: the one in the userinfo
  (everything between ``://`` and the LAST ``@``, so a password holding an unencoded
  ``/``, ``?``, ``#`` or ``@`` is hidden whole) and any ``password`` / ``sslpassword``
  query parameter (its name percent-encoded or not) become ``***``; a text that is not
  ``SCHEME://...`` (a libpq ``key=value`` string, ``user:pw@host``) is not shown at all.
  Every message and log line naming a store URL uses it.
- ``scrub`` removes from a driver's message the URL and every secret of it, raw and
  percent-decoded (libpq quotes decoded values).
- ``check_url`` raises ``BadStoreUrl`` (a ``ValueError``) with the redacted URL only.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus, urlsplit

SCHEMES = ("postgresql", "postgres")
_HIDDEN = "***"
_NOT_A_URL = "<not shown: not a SCHEME:// URL>"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


class BadStoreUrl(ValueError):
    """The store URL is not one Corral can use; the message says why (without secrets)."""


def _is_secret_key(key: str) -> bool:
    return "password" in unquote_plus(key).strip().lower()


def _split(url: str) -> tuple[str, str | None, str] | None:
    """(``SCHEME://``, the userinfo or None, the rest after it); None: not a URL. The
    userinfo runs to the LAST ``@``: one in the query is taken as part of it too, which
    hides more than needed but never shows a password with an unencoded delimiter."""
    m = _SCHEME.match(url)
    if m is None:
        return None
    rest = url[m.end():]
    userinfo, at, tail = rest.rpartition("@")
    return (m.group(0), userinfo, tail) if at else (m.group(0), None, rest)


def _secrets(url: str) -> list[str]:
    """The secret parts of ``url`` as written (not decoded)."""
    parts = _split(url)
    if parts is None:
        return [url]  # not shown at all
    found = []
    _, userinfo, tail = parts
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        if any(c in user for c in "/?#"):
            found.append(userinfo)
        elif colon and password:
            found.append(password)
    _, _, query = tail.partition("?")
    for pair in query.split("#", 1)[0].split("&"):
        key, eq, value = pair.partition("=")
        if eq and value and _is_secret_key(key):
            found.append(value)
    return found


def redact(url: str) -> str:
    """``url`` with its passwords replaced by ``***`` (never raises)."""
    parts = _split(url)
    if parts is None:
        return _NOT_A_URL
    scheme, userinfo, tail = parts
    shown = scheme
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        if any(c in user for c in "/?#"):
            shown += f"{_HIDDEN}@"
        else:
            shown += f"{user}:{_HIDDEN}@" if colon else f"{user}@"
    head, q, query = tail.partition("?")
    if q:
        query, hash_, fragment = query.partition("#")
        pairs = []
        for pair in query.split("&"):
            key, eq, _ = pair.partition("=")
            pairs.append(f"{key}={_HIDDEN}" if eq and _is_secret_key(key) else pair)
        head += "?" + "&".join(pairs) + hash_ + fragment
    return shown + head


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's message) without ``url`` (shown redacted) or its secrets,
    as written or percent-decoded."""
    text = text.replace(url, redact(url))
    for secret in _secrets(url):
        for form in {secret, unquote(secret), unquote_plus(secret)}:
            if form:
                text = text.replace(form, _HIDDEN)
    return text


def _why(exc: ValueError) -> str:
    """urllib's reason, without the value it quotes (a piece of a password, maybe)."""
    text = str(exc)
    if "Port" in text or "port" in text:
        return "the port must be a number from 1 to 65535"
    return text.split(":", 1)[0].split("'", 1)[0].strip() or "unparsable"


def check_url(url: object) -> str:
    """Return ``url`` if it names a PostgreSQL database, else raise ``BadStoreUrl``."""
    if not isinstance(url, str) or not url.strip():
        raise BadStoreUrl("the store url must be a non-empty string")
    shown = redact(url)
    if _split(url) is None or not url.startswith(tuple(f"{s}://" for s in SCHEMES)):
        raise BadStoreUrl(f"{shown}: the store url must start with postgresql:// "
                          "(leave [store] out for the embedded SQLite store)")
    try:
        parts = urlsplit(url)
        # libpq's several hosts (a failover list): HOST1:PORT1,HOST2:PORT2
        hosts = [urlsplit(f"//{h}") for h in parts.netloc.rpartition("@")[2].split(",")]
        ports = [h.port for h in hosts]
    except ValueError as exc:
        raise BadStoreUrl(f"{shown}: not a valid URL ({_why(exc)}; percent-encode "
                          "'/', '?', '#', '@' and ':' in the user name and password: "
                          "%2F %3F %23 %40 %3A)") from None
    if "@" in parts.path:
        raise BadStoreUrl(f"{shown}: an '@' after the host; percent-encode '/', '?', '#' "
                          "and '@' in the user name and password: %2F %3F %23 %40")
    if not any(h.hostname for h in hosts) and "host=" not in parts.query:
        raise BadStoreUrl(f"{shown}: names no host (postgresql://USER@HOST:PORT/DBNAME)")
    if 0 in ports:
        raise BadStoreUrl(f"{shown}: port 0 is not a port")
    if not parts.path.strip("/"):
        raise BadStoreUrl(f"{shown}: names no database (postgresql://USER@HOST:PORT/DBNAME)")
    if any(c in url for c in "\x00\r\n"):
        raise BadStoreUrl(f"{shown}: holds a control character")
    return url
