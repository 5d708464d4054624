"""Connecting to Temporal the same way from every component."""

from __future__ import annotations

import asyncio
import time

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from ..domain.ids import DeploymentId
from ..names import SIGNAL_NODES_CHANGED, deployment_workflow_id


async def connect(address: str, namespace: str, *, wait: float = 0.0) -> Client:
    """A client for ``address`` and ``namespace``, using the pydantic converter.

    Every component connects through here (the agent with the address the API hands it),
    so none can forget the converter and send payloads the others cannot read.

    ``wait`` retries a refused connection for that many seconds: under ``up`` and in
    compose the server may still be starting when a component starts.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            return await Client.connect(
                address,
                namespace=namespace,
                data_converter=pydantic_data_converter,
            )
        except (RPCError, RuntimeError, OSError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def signal_unplaceable(client: Client, deployment_ids: list[str]) -> int:
    """Tell deployments waiting for room (cant_place, or degraded with a replacement that
    found none) that the nodes changed, so they retry now rather than at their next timer.
    Returns how many were signalled."""
    sent = 0
    for deployment_id in deployment_ids:
        handle = client.get_workflow_handle(deployment_workflow_id(DeploymentId(deployment_id)))
        try:
            await handle.signal(SIGNAL_NODES_CHANGED)
            sent += 1
        except RPCError:
            continue  # it finished meanwhile (deleted): nothing to retry
    return sent
