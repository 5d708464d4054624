"""The one port table: each port `up` binds, with its flag and settings field.

Its own module, free of asyncpg and httpx, so that building the command line (every
`modelkeeper` command) does not import the stack to learn the flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PortUse:
    """A port `up` binds, with the flag and settings field that change it."""

    label: str
    field: str
    flag: str


#: In the order `up` lists them.
PORTS = [
    PortUse("the API", "api_port", "--api-port"),
    PortUse("the gateway", "gateway_port", "--gateway-port"),
    PortUse("PostgreSQL", "postgres_port", "--postgres-port"),
    PortUse("Temporal", "temporal_port", "--temporal-port"),
    PortUse("the Temporal web UI", "temporal_ui_port", "--temporal-ui-port"),
    PortUse("Temporal's HTTP API", "temporal_http_port", "--temporal-http-port"),
    PortUse("Temporal's metrics", "temporal_metrics_port", "--temporal-metrics-port"),
    PortUse("Temporal's mTLS front", "temporal_mtls_port", "--temporal-mtls-port"),
]

#: The flag of each settings field that is a port.
PORT_FLAGS = {use.field: use.flag for use in PORTS}
