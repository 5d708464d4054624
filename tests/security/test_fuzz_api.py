"""Schemathesis fuzzes the control API's OpenAPI spec (:mod:`bench.fuzz.schema`: every
phase, every check), against the app served over HTTP as `modelkeeper api` serves it, in
this process, with a real store, a real Temporal server and the control worker (so
deletes, scales and sagas run; no node ever registers, so nothing places).

The app is served over real HTTP on loopback by uvicorn in the test's event loop, where
its store pool and Temporal client live; schemathesis runs in a thread and calls it as
any client would. (Its ASGI transport would drive the app from an event loop of its own,
on which the app's connections cannot be used.)

The run is bounded (``MAX_EXAMPLES`` per operation, ``STATEFUL_MAX_STEPS``, a fixed
seed) so the suite stays fast; it is marked slow. The long runs, with other seeds, are
``python -m bench.fuzz.run`` (bench/results/fuzz.md). The report of a failing run lists
each failure with the request that reproduces it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from api.server import served
from bench.fuzz.schema import fuzz
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from worker.main import run_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.long]

#: Examples per operation and phase: enough to find the classes of failure schemathesis
#: knows (the first run of 997 cases found 27), few enough for about a minute on 2 cores.
MAX_EXAMPLES = 10
#: Steps of one stateful scenario (create a model, deploy it, scale it, delete it...).
STATEFUL_MAX_STEPS = 10
#: The suite's seed; the long runs use others (bench/results/fuzz.md).
SEED = 11


@pytest.fixture
async def served_api(local_temporal_env: WorkflowEnvironment,
                     database_url: str) -> AsyncIterator[tuple[str, str]]:
    """The API with operator tokens on, served on loopback: its URL and an admin token."""
    client = local_temporal_env.client
    settings = Settings(
        database_url=database_url, temporal_address=client.service_client.config.target_host,
        temporal_namespace=client.namespace, engine_key_secret="fuzz-engine-secret",
        settling_window_s=0, api_port=free_port())
    app = create_app(settings)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_stopped, worker, stop)
        url = await stack.enter_async_context(served(app, settings))
        store: Store = app.state.store
        _, token = await store.tokens.create_token("fuzz", OperatorRole.ADMIN)
        yield url, token


async def _stopped(worker: asyncio.Task[None], stop: asyncio.Event) -> None:
    stop.set()
    await worker


async def test_the_openapi_spec_holds_under_fuzzing(served_api: tuple[str, str]) -> None:
    base_url, token = served_api
    report = await asyncio.to_thread(fuzz, base_url, token, seed=SEED,
                                     max_examples=MAX_EXAMPLES,
                                     stateful_max_steps=STATEFUL_MAX_STEPS)
    print("\n" + report.describe())
    assert "stateful" in report.phases and report.cases > 100, report.describe()
    assert not report.failures and not report.errors, report.describe()
