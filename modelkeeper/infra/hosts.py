"""Which ``Host`` headers a server on this machine answers: the rule the API and the
gateway share (each with its own setting of extra names).

A web page on a name its owner points at 127.0.0.1 (DNS rebinding) makes the browser send
requests to a server on loopback, but with the page's own name in ``Host``: answering only
the names the server is really reached by stops it (Ollama's CVE-2024-28224 was this).
The names: ``localhost``, ``127.0.0.1``, ``::1``, the bind host unless it is a wildcard,
the operator's, and for a server bound to a wildcard this machine's current addresses
(:class:`OwnAddresses`): a page that rebinds a name sends the name, never an address of
this machine.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Iterable

from .network import is_wildcard, machine_addresses

#: Names every server answers to: what `up`, the CLI and a probe on the machine use.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: In the allowed names: answer every Host (behind a proxy that checks it).
ANY_HOST = "*"
#: How often, at most, a wildcard-bound server reads this machine's addresses again for a
#: Host it does not know: often enough that an interface added after start (a VPN, the
#: veth of docs/first-hour.md) works within seconds, rarely enough that a flood of
#: unknown Hosts costs one read of the interfaces per period.
OWN_ADDRESSES_TTL_S = 2.0


def allowed_hosts(bind_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The names a server bound to ``bind_host`` answers to: loopback, the bind host
    unless it is a wildcard, and ``extra`` (the operator's, lower case)."""
    bind = bind_host.strip("[]").lower()
    own = {bind} if not is_wildcard(bind) else set()
    return LOOPBACK_HOSTS | own | frozenset(extra)


class OwnAddresses:
    """This machine's addresses as they are now, read again at most every ``ttl_s``.

    For a server bound to a wildcard: it is reached by any address of the machine,
    including one added after it started. An address of the machine itself is no DNS
    rebinding risk: a page that rebinds a name sends the name, never this machine's address.
    """

    def __init__(self, read: Callable[[], frozenset[str]] = machine_addresses, *,
                 ttl_s: float = OWN_ADDRESSES_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._clock = clock
        self._known: frozenset[str] = frozenset()
        self._read_at: float | None = None

    def __contains__(self, host: object) -> bool:
        if not isinstance(host, str) or not _is_address(host):
            return False  # a name is never re-read: that is the rebinding guard
        if host in self._known:
            return True
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self._ttl_s:
            self._known, self._read_at = self._read(), now
        return host in self._known


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def host_name(header: str | None) -> str | None:
    """The host of a ``Host`` header, lower case, without port or IPv6 brackets."""
    if not header:
        return None
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") > 1:
        return value  # an IPv6 address without brackets (and so without a port)
    return value.partition(":")[0]


def host_allowed(header: str | None, allowed: frozenset[str],
                 own_addresses: OwnAddresses | None) -> bool:
    """Whether a request with this ``Host`` header is answered (``own_addresses``: also
    this machine's current addresses, for a wildcard bind; None: ``allowed`` only)."""
    if ANY_HOST in allowed:
        return True
    host = host_name(header)
    return host in allowed or (own_addresses is not None and host in own_addresses)
