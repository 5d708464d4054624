"""Schemathesis against the control API's OpenAPI spec: every phase (examples, coverage,
fuzzing, and the stateful phase that chains calls through the spec's links) and every
check (no server error, every status code and body as documented, invalid data refused,
valid data accepted, auth not ignored). One home for the run's configuration and its
report: the suite's short run (tests/security/test_fuzz_api.py) and the long ones
(:mod:`bench.fuzz.run`) call :func:`fuzz`.

schemathesis runs in the calling thread and calls the API as any client would, over HTTP.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events
from schemathesis.engine.recorder import ScenarioRecorder

#: Checks that do not apply where the API answers by design otherwise than schemathesis
#: assumes, each with its reason.
CHECK_EXCEPTIONS: list[dict[str, Any]] = [
    # DELETE /deployments/{id} answers 202: the deployment's workflow stops its replicas
    # and removes it afterwards, so a GET right after still finds it ("deleting").
    {"include-path": "/deployments/{deployment_id}",
     "checks": {"use_after_free": {"enabled": False}}},
    # engine_args is an open map in the schema, judged against the allow-list of the
    # model's engine (known only from the catalog), PATCH takes exactly one of replicas,
    # scaling and engine_args, and a policy's sleep_after_s must be below its
    # idle_timeout_s: a schema-valid body may still be a 422 naming the rule.
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
    # A sleep is the deployment workflow's to refuse: with no replica whose engine can
    # sleep (no node registers in the fuzz run, so none ever runs), a schema-valid
    # request is a 409 with the workflow's sentence.
    {"include-path": "/deployments/{deployment_id}/sleep",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    {"include-path": "/placement/explain",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
    # GET /events' deployment and node filters must name one, by id or name (a deployment
    # gone but in the log by its id too): schema-valid, still a 422 naming the filter.
    {"include-path": "/events", "include-method": "GET",
     "checks": {"positive_data_acceptance": {"enabled": False}}},
]
#: Operation ids hold slashes (restart/d-1/3): values learned from responses are filtered
#: out as path parameters, which Hypothesis reports as a failed health check.
SUPPRESSED_HEALTH_CHECKS = ["filter_too_much"]
#: A request the API does not answer within this is a failure of its own.
REQUEST_TIMEOUT_S = 30
#: How many distinct reproductions of one failure a report keeps.
EXAMPLES_PER_FAILURE = 3


@dataclass
class Report:
    """What one run found."""

    cases: int = 0
    scenarios: int = 0
    #: Responses by status code, every response of the run.
    statuses: Counter[int] = field(default_factory=Counter)
    #: Unique failures ("check: title") and where each was seen.
    failures: dict[str, list[str]] = field(default_factory=dict)
    #: Failed checks by check name, every occurrence counted.
    failed_checks: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status >= 500)

    def describe(self) -> str:
        lines = [f"{self.cases} cases in {self.scenarios} scenarios, phases "
                 f"{', '.join(self.phases)}; responses "
                 f"{dict(sorted(self.statuses.items()))}; {len(self.failures)} unique "
                 f"failures, {len(self.errors)} errors"]
        for title, where in sorted(self.failures.items()):
            lines.append(f"- {title}\n    " + "\n    ".join(
                sorted(set(where))[:EXAMPLES_PER_FAILURE]))
        lines += [f"! {error}" for error in self.errors]
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"cases": self.cases, "scenarios": self.scenarios, "phases": self.phases,
                "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items())},
                "server_errors": self.server_errors,
                "failures_by_check": dict(sorted(self.failed_checks.items())),
                "unique_failures": {title: sorted(set(where))[:EXAMPLES_PER_FAILURE]
                                    for title, where in sorted(self.failures.items())},
                "errors": self.errors}


def fuzz(base_url: str, token: str | None, *, seed: int, max_examples: int,
         stateful_max_steps: int, max_time_s: int | None = None) -> Report:
    """Run every phase and check of schemathesis against ``base_url`` (with ``token`` as
    the bearer, or none); what it found. With ``max_time_s`` the phases are cycled until
    that time is spent; otherwise each runs ``max_examples`` per operation once."""
    settings: dict[str, Any] = {
        "base-url": base_url,
        "seed": seed,
        "suppress-health-check": SUPPRESSED_HEALTH_CHECKS,
        "headers": {"Authorization": f"Bearer {token}"} if token else {},
        "generation": {"max-examples": max_examples, "database": "none"},
        "checks": {"enabled": True},
        "phases": {"stateful": {"enabled": True, "max-steps": stateful_max_steps}},
        "request-timeout": REQUEST_TIMEOUT_S,
        "continue-on-failure": True,
        "warnings": False,
        "operations": CHECK_EXCEPTIONS,
    }
    if max_time_s is not None:
        settings["max-time"] = max_time_s
    config = SchemathesisConfig.from_dict(settings)
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", config=config)
    report = Report()
    for event in schemathesis.engine.from_schema(schema).execute():
        match event:
            case events.PhaseFinished(phase=phase) if phase.is_enabled:
                if phase.name.value not in report.phases:
                    report.phases.append(phase.name.value)
            case events.ScenarioFinished(recorder=recorder):
                _record(report, recorder)
            case events.NonFatalError(label=label, value=value):
                report.errors.append(f"{label}: {value!r}"[:500])
            case events.FatalError(exception=exception):
                report.errors.append(f"fatal: {exception!r}"[:500])
    return report


def _record(report: Report, recorder: ScenarioRecorder) -> None:
    report.scenarios += 1
    report.cases += len(recorder.cases)
    for interaction in recorder.interactions.values():
        if interaction.response is not None:
            report.statuses[interaction.response.status_code] += 1
    for case_id, checks in recorder.checks.items():
        for check in checks:
            if check.status is not Status.FAILURE or check.failure_info is None:
                continue
            case = recorder.cases[case_id].value
            failure = check.failure_info.failure
            report.failed_checks[check.name] += 1
            report.failures.setdefault(f"{check.name}: {failure.title}", []).append(
                f"{case.method} {case.formatted_path}: {failure.message[:300]}"
                f"\n      {check.failure_info.code_sample[:600]}")
