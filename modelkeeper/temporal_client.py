"""Connecting to Temporal the same way from every component."""

from __future__ import annotations

import asyncio
import time

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from .settings import Settings


async def connect(settings: Settings, *, wait: float = 0.0) -> Client:
    """A client for the configured address and namespace, using the pydantic converter.

    ``wait`` retries a refused connection for that many seconds: under ``up`` and in
    compose the server may still be starting when a component starts.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            return await Client.connect(
                settings.temporal_address,
                namespace=settings.temporal_namespace,
                data_converter=pydantic_data_converter,
            )
        except (RPCError, RuntimeError, OSError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)
