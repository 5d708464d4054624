"""What a request must show before the gateway looks at it: a ``Host`` it answers to, a
JSON body, and for ``/metrics`` the scraper's token.

A web page can make a browser send requests anywhere, but only "simple" ones without
asking: a ``text/plain`` POST, with the page's own name in ``Host``. With client auth off
(``up``), that was enough to use every model from any page a user opened, and, by DNS
rebinding, to read the answers. The ``Host`` allowlist (the API's rule,
:mod:`modelkeeper.infra.hosts`) stops the rebinding, and requiring
``Content-Type: application/json`` on bodies stops the blind POSTs: a page cannot send
that type without a CORS preflight, which the gateway never grants.

Each check runs on every request, so each has a fast path: the raw ``Host`` values the
gateway expects (``127.0.0.1:PORT``...) are one set lookup, and ``application/json``
as clients send it one comparison.
"""

from __future__ import annotations

import hashlib
import hmac
import socket

from modelkeeper.infra.hosts import ANY_HOST, OwnAddresses, allowed_hosts, host_allowed
from modelkeeper.infra.network import is_wildcard
from modelkeeper.settings import Settings

from .responses import ErrorReply

JSON_TYPE = b"application/json"


class HostCheck:
    """The ``Host`` headers this gateway answers: loopback, its bind host, the names in
    ``gateway_allowed_hosts``, and, bound to a wildcard (``up --bind-host 0.0.0.0``), this
    machine's name and current addresses, by which other machines reach it (as `up`
    gives the API its ``machine_names``)."""

    def __init__(self, settings: Settings,
                 own_addresses: OwnAddresses | None = None) -> None:
        wildcard = is_wildcard(settings.bind_host)
        extra = list(settings.gateway_allowed_hosts)
        if wildcard:
            extra.append(socket.gethostname().lower())
        self.allowed = allowed_hosts(settings.bind_host, extra)
        self.own_addresses = (own_addresses or OwnAddresses()) if wildcard else None
        self._any = ANY_HOST in self.allowed
        port = settings.gateway_port
        # The header values clients send, as they send them: name, or name and port.
        raw: set[bytes] = set()
        for name in self.allowed:
            shown = f"[{name}]" if ":" in name else name
            raw |= {shown.encode(), f"{shown}:{port}".encode()}
        self._raw = frozenset(raw)

    def refusal(self, header: bytes | None) -> ErrorReply | None:
        """None when a request with this ``Host`` is answered; else the 400 naming it."""
        if self._any or header in self._raw:
            return None
        text = None if header is None else header.decode("latin-1")
        if host_allowed(text, self.allowed, self.own_addresses):
            return None
        sent = f"Host {text!r}" if text else "no Host header"
        own = " and this machine's addresses" if self.own_addresses is not None else ""
        return ErrorReply(
            400, f"{sent}: this gateway answers only to {', '.join(sorted(self.allowed))}"
            f"{own}; if clients reach it by another name, add that name to "
            "MODELKEEPER_GATEWAY_ALLOWED_HOSTS", "invalid_request_error", "host_not_allowed")


def json_body_refusal(content_type: bytes | None) -> ErrorReply | None:
    """None when a body is declared as JSON (``application/json``, any parameters); else
    the 415 naming what was sent."""
    if content_type == JSON_TYPE or (
            content_type is not None
            and content_type.split(b";", 1)[0].strip().lower() == JSON_TYPE):
        return None
    sent = ("no `Content-Type`" if content_type is None
            else f"`Content-Type` {content_type.decode('latin-1')!r}")
    return ErrorReply(415, f"The body was sent with {sent}: send it as `application/json`.",
                      "invalid_request_error", "unsupported_media_type")


class MetricsGuard:
    """Who may read ``/metrics``: anyone while client auth is off and no metrics token is
    set (`up`, on loopback); otherwise a scraper sending the token of
    ``gateway_metrics_token_file`` as a bearer token. With auth on and no token set,
    nobody: the metrics name every model and replica, which a client key does not."""

    def __init__(self, token: str | None, *, auth: bool) -> None:
        #: Only the token's digest is kept; digests are compared in constant time.
        self._digest = None if token is None else hashlib.sha256(token.encode()).digest()
        self.open = not auth and token is None

    def refusal(self, authorization: bytes | None) -> ErrorReply | None:
        """None when a request with this ``Authorization`` may read the metrics."""
        if self.open:
            return None
        if self._digest is None:
            return ErrorReply(
                403, "/metrics needs a token while client auth is on: set "
                "MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE on the gateway and send its token "
                "as `Authorization: Bearer <token>`.", "permission_error", "metrics_token_unset")
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(
                hashlib.sha256(token.strip()).digest(), self._digest):
            return None
        return ErrorReply(
            401, "/metrics needs the token of MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE, sent as "
            "`Authorization: Bearer <token>`.", "authentication_error", "invalid_metrics_token",
            headers=[(b"www-authenticate", b"Bearer")])
