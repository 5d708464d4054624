"""``host:port`` addresses, written and read one way everywhere. Stdlib only: the sim
engine imports it, and its start-up time is part of what the cold-start bench measures."""

from __future__ import annotations


def format_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (as :func:`agent.engines.gpu.leader_host_port`
    and the engines' own flags read it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` from ``host:port`` or ``[v6]:port``; None when it is neither."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)
