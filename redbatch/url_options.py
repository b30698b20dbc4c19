"""The options of a Redis URL (after ``?``).  A ``redis+cluster://`` or
``redis+sentinel://`` URL's: TLS to the data nodes, and the sentinels' own credentials
and TLS.  A plain URL's (``check_plain``): ``db``, on ``unix://`` ``username`` and
``password`` too, and on ``rediss://`` the TLS options below.

* ``ssl=true`` turns TLS on; ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
  ``ssl_cert_reqs`` (``none``, ``optional``, ``required``: the default) and
  ``ssl_check_hostname`` are redis-py's, as on a ``rediss://`` URL, and need it.
* Sentinel only: ``sentinel_username`` and ``sentinel_password`` (the sentinels'
  ``requirepass``; the URL's user and password are the data nodes'), and
  ``sentinel_ssl`` (TLS to the sentinels too; by default as ``ssl``).

Errors name the option, never its value (a password may be one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

TRUE, FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
CERT_REQS = frozenset({"none", "optional", "required"})
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", "sentinel_ssl")


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in TRUE | FALSE:
        raise ValueError("is not true or false")
    return lowered in TRUE


def _cert_reqs(text: str) -> str:
    if text.strip().lower() not in CERT_REQS:
        raise ValueError("is not none, optional or required")
    return text.strip().lower()


def _text(text: str) -> str:
    if not text:
        raise ValueError("is empty")
    return text


TLS_OPTIONS: dict[str, Callable[[str], Any]] = {
    "ssl_ca_certs": _text, "ssl_certfile": _text, "ssl_keyfile": _text,
    "ssl_cert_reqs": _cert_reqs, "ssl_check_hostname": _flag}


@dataclass(frozen=True)
class NodeOptions:
    """TLS keyword arguments for the data nodes' connections (empty: no TLS), and the
    sentinels' credentials and TLS."""

    tls: tuple[tuple[str, Any], ...] = ()
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    sentinel_tls: bool = False

    def sentinel_kwargs(self) -> dict[str, Any]:
        """What the sentinels' connections take beyond the timeouts."""
        out: dict[str, Any] = dict(self.tls) if self.sentinel_tls else {}
        if self.sentinel_username is not None:
            out["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        return out


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError("is not a database number")
    return int(text)


# A plain URL's options (redis-py's ``from_url`` takes them over the settings, so a
# timeout in the query would pass every check and replace the settings' own): a
# database, a socket's credentials, TLS on ``rediss://``; nothing else.
def _plain_flag(text: str) -> bool:
    """A flag as redis-py reads it from a plain URL, which it parses itself: ``off``
    or `` false`` would read as true there, so only these spellings are taken."""
    if text.lower() not in {"1", "true", "yes", "0", "false", "no"}:
        raise ValueError("is not one of 1, true, yes, 0, false, no")
    return text.lower() in TRUE


def _plain_cert_reqs(text: str) -> str:
    """As redis-py reads it from a plain URL: lower case, nothing around it."""
    if text not in CERT_REQS:
        raise ValueError("is not none, optional or required (lower case)")
    return text


PLAIN_TLS: dict[str, Callable[[str], Any]] = {
    **TLS_OPTIONS, "ssl_cert_reqs": _plain_cert_reqs, "ssl_check_hostname": _plain_flag}

PLAIN_OPTIONS: dict[str, dict[str, Callable[[str], Any]]] = {
    "redis": {"db": _db},
    "rediss": {"db": _db, **PLAIN_TLS},
    "unix": {"db": _db, "username": _text, "password": _text},
}


def check_plain(query: str, scheme: str) -> None:
    """The options of a ``redis://``, ``rediss://`` or ``unix://`` URL's query;
    ``ValueError`` naming the bad option (``PLAIN_OPTIONS``)."""
    given = dict(parse_qsl(query, keep_blank_values=True))
    known = PLAIN_OPTIONS[scheme]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"option {unknown[0]!r} is not one of {', '.join(sorted(known))}")
    for name, parse_one in known.items():
        _checked(given, name, parse_one, None)


def parse(query: str, sentinel: bool) -> NodeOptions:
    """The options of a URL's query; ``ValueError`` naming the bad option."""
    given = dict(parse_qsl(query, keep_blank_values=True))
    known = {"ssl", *TLS_OPTIONS, *(SENTINEL_OPTIONS if sentinel else ())}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"option {unknown[0]!r} is not one of {', '.join(sorted(known))}")
    ssl = _checked(given, "ssl", _flag, False)
    tls = tuple((name, _checked(given, name, parse_one, None))
                for name, parse_one in TLS_OPTIONS.items() if name in given)
    if tls and not ssl:
        raise ValueError(f"option {tls[0][0]!r} needs ssl=true")
    return NodeOptions((("ssl", True), *tls) if ssl else (),
                       given.get("sentinel_username"), given.get("sentinel_password"),
                       _checked(given, "sentinel_ssl", _flag, ssl))


def _checked(given: dict[str, str], name: str, parse_one: Callable[[str], Any],
             default: Any) -> Any:
    if name not in given:
        return default
    try:
        return parse_one(given[name])
    except ValueError as exc:
        raise ValueError(f"option {name!r} {exc}") from None
