"""This machine's names on the network: what other machines may reach it by."""

from __future__ import annotations

import socket

import psutil

from ..domain.nodes import is_loopback

#: Bind addresses that listen on every interface: they name no machine.
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def is_wildcard(bind_host: str) -> bool:
    """Whether ``bind_host`` (brackets allowed) listens on every interface."""
    return bind_host.strip("[]") in WILDCARD_BINDS


def machine_addresses() -> frozenset[str]:
    """This machine's addresses other machines may use, now, lower case: no loopback, and
    no IPv6 link-local (it needs a zone, which no Host header carries). An interface added
    since the process started (a VPN, a veth) is in it."""
    found: set[str] = set()
    for addresses in psutil.net_if_addrs().values():
        for addr in addresses:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            host = addr.address.split("%")[0].lower()
            if is_loopback(host) or host.startswith("fe80:"):
                continue
            found.add(host)
    return frozenset(found)


def machine_names() -> list[str]:
    """This machine's host name and then its addresses (:func:`machine_addresses`)."""
    return list(dict.fromkeys([socket.gethostname().lower(), *sorted(machine_addresses())]))
