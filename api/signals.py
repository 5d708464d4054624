"""Signals the API sends to deployment workflows on its own initiative."""

from __future__ import annotations

from temporalio.client import Client

from modelkeeper.infra.temporal import signal_unplaceable
from modelkeeper.store import Store


async def signal_waiting_deployments(store: Store, temporal: Client) -> int:
    """Tell every deployment waiting for room (cant_place, and degraded: its surge
    replacement found none) to try placing now.

    Called whenever the room on the nodes may have grown, so a waiting deployment does not
    sit out its retry timer. Returns how many were signalled.
    """
    waiting = await store.deployments.deployment_ids_waiting_for_room()
    return await signal_unplaceable(temporal, waiting)
