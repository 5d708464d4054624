"""Schemathesis fuzzes the control API's OpenAPI spec: every phase (examples, coverage,
fuzzing, and the stateful phase that chains calls through the spec's links), every check
(no server error, every status code and body as documented, invalid data refused, valid
data accepted, auth not ignored), against the app in this process with a real store, a
real Temporal server and the control worker (so deletes, scales and sagas run; no node
ever registers, so nothing places).

The app is served over real HTTP on loopback by uvicorn in the test's event loop, where
its store pool and Temporal client live; schemathesis runs in a thread and calls it as
any client would. (Its ASGI transport would drive the app from an event loop of its own,
on which the app's connections cannot be used.)

The run is bounded (``MAX_EXAMPLES`` per operation, ``STATEFUL_MAX_STEPS``, a fixed
seed) so the suite stays fast; it is marked slow. The report of a failing run lists each
failure with the request that reproduces it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import schemathesis
import uvicorn
from fastapi import FastAPI
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events
from temporalio.testing import WorkflowEnvironment

from api.app import create_app
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.infra.processes import free_port
from modelkeeper.settings import Settings
from modelkeeper.store import Store
from modelkeeper.store.tokens import TokensStore
from worker.main import run_worker

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HOST = "127.0.0.1"
#: Examples per operation and phase: enough to find the classes of failure schemathesis
#: knows (the first run of 997 cases found 27), few enough for about a minute on 2 cores.
MAX_EXAMPLES = 10
#: Steps of one stateful scenario (create a model, deploy it, scale it, delete it...).
STATEFUL_MAX_STEPS = 10
SEED = 11
#: Checks that do not apply where the API answers by design otherwise than schemathesis
#: assumes, each with its reason.
CHECK_EXCEPTIONS = [
    # DELETE /deployments/{id} answers 202: the deployment's workflow stops its replicas
    # and removes it afterwards, so a GET right after still finds it ("deleting").
    {"include-path": "/deployments/{deployment_id}",
     "checks": {"use_after_free": {"enabled": False}}},
    # engine_args is an open map in the schema, judged against the allow-list of the
    # model's engine (known only from the catalog), and PATCH takes exactly one of
    # replicas and engine_args: a schema-valid body may still be a 422 naming the rule.
    {"include-path": "/deployments/{deployment_id}", "include-method": "PATCH",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    {"include-path": "/deployments/{deployment_id}/reconfigure",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    # A model's source is judged by the source policy (settings: schemes, hosts, roots)
    # and its engine_args by its engine's allow-list: schema-valid, still a 422 naming
    # the rule.
    {"include-path": "/models", "include-method": "POST",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    # A body naming a model that is not in the catalog is a 422 naming model_id (the
    # field is wrong), as POST /deployments answers it, not the 404 schemathesis expects.
    {"include-path": "/deployments/{deployment_id}/switch",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    # node_ids must name registered nodes, by id or name (api.nodes.resolve_node_ids):
    # schema-valid, still a 422 listing the known nodes.
    {"include-path": "/deployments", "include-method": "POST",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    {"include-path": "/placement/explain",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
]
#: Operation ids hold slashes (restart/d-1/3): values learned from responses are filtered
#: out as path parameters, which Hypothesis reports as a failed health check.
SUPPRESSED_HEALTH_CHECKS = ["filter_too_much"]


@dataclass
class Report:
    """What one run found."""

    cases: int = 0
    scenarios: int = 0
    failures: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"{self.cases} cases in {self.scenarios} scenarios, phases "
                 f"{', '.join(self.phases)}; {len(self.failures)} unique failures, "
                 f"{len(self.errors)} errors"]
        for title, where in sorted(self.failures.items()):
            lines.append(f"- {title}\n    " + "\n    ".join(sorted(set(where))[:3]))
        lines += [f"! {error}" for error in self.errors]
        return "\n".join(lines)


def fuzz(base_url: str, token: str) -> Report:
    """Run every phase and check of schemathesis against ``base_url``; what it found."""
    config = SchemathesisConfig.from_dict({
        "base-url": base_url,
        "seed": SEED,
        "suppress-health-check": SUPPRESSED_HEALTH_CHECKS,
        "headers": {"Authorization": f"Bearer {token}"},
        "generation": {"max-examples": MAX_EXAMPLES, "database": "none"},
        "checks": {"enabled": True},
        "phases": {"stateful": {"enabled": True, "max-steps": STATEFUL_MAX_STEPS}},
        "request-timeout": 30,
        "continue-on-failure": True,
        "warnings": False,
        "operations": CHECK_EXCEPTIONS,
    })
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config)
    report = Report()
    for event in schemathesis.engine.from_schema(schema).execute():
        match event:
            case events.PhaseFinished(phase=phase) if phase.is_enabled:
                report.phases.append(phase.name.value)
            case events.ScenarioFinished(recorder=recorder):
                report.scenarios += 1
                report.cases += len(recorder.cases)
                for case_id, checks in recorder.checks.items():
                    for check in checks:
                        if check.status is not Status.FAILURE or check.failure_info is None:
                            continue
                        case = recorder.cases[case_id].value
                        failure = check.failure_info.failure
                        title = f"{check.name}: {failure.title}"
                        report.failures.setdefault(title, []).append(
                            f"{case.method} {case.formatted_path}: {failure.message[:300]}"
                            f"\n      {check.failure_info.code_sample[:600]}")
            case events.NonFatalError(label=label, value=value):
                report.errors.append(f"{label}: {value!r}"[:500])
            case events.FatalError(exception=exception):
                report.errors.append(f"fatal: {exception!r}"[:500])
    return report


class _EmbeddedServer(uvicorn.Server):
    """Leaves the process's signal handlers to pytest."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@pytest.fixture
async def served(local_temporal_env: WorkflowEnvironment,
                 database_url: str) -> AsyncIterator[tuple[str, str]]:
    """The API with operator tokens on, served on loopback: its URL and an admin token."""
    client = local_temporal_env.client
    settings = Settings(
        database_url=database_url, temporal_address=client.service_client.config.target_host,
        temporal_namespace=client.namespace, engine_key_secret="fuzz-engine-secret",
        settling_window_s=0)
    app: FastAPI = create_app(settings)
    port = free_port()
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop))
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_stopped, worker, stop)
        await stack.enter_async_context(app.router.lifespan_context(app))
        store: Store = app.state.store
        _, token = await TokensStore.of(store).create_token("fuzz", OperatorRole.ADMIN)
        server = _EmbeddedServer(uvicorn.Config(app, host=HOST, port=port, lifespan="off",
                                                log_level="warning", access_log=False))
        task = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not task.done(), "the API failed to start"
                await asyncio.sleep(0.01)
            yield f"http://{HOST}:{port}", token
        finally:
            server.should_exit = True
            await task


async def _stopped(worker: asyncio.Task[None], stop: asyncio.Event) -> None:
    stop.set()
    await worker


async def test_the_openapi_spec_holds_under_fuzzing(served: tuple[str, str]) -> None:
    base_url, token = served
    report = await asyncio.to_thread(fuzz, base_url, token)
    print("\n" + report.describe())
    assert "stateful" in report.phases and report.cases > 100, report.describe()
    assert not report.failures and not report.errors, report.describe()
