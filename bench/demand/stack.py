"""The demand bench's hold on a running stack: the API as an operator, the gateway as a
client, Temporal for history lengths, and the few calls every scenario makes (declare a
sim model, deploy it with a scaling policy, wait for a status, read its demand events)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
from temporalio.client import Client

from bench.fleet.stack import Fleet
from modelkeeper.domain.tunables import Tunables
from modelkeeper.settings import Settings, env_var_names

MiB, GiB = 1 << 20, 1 << 30
#: What a sim replica really holds: its claim is only declared (several on one machine
#: would crowd it otherwise); half of it is its weights, kept while asleep.
SIM_REAL_MEMORY = 16 * MiB
SIM_REAL_WEIGHTS = 8 * MiB
#: A new deployment reaches the gateway in milliseconds; this long means it never will.
ROUTED_TIMEOUT_S = 30.0
#: A history unchanged this long has taken in a step's trailing writes (each an activity
#: of tens of milliseconds; a drain before a sleep waits up to a usage flush, 1 s).
QUIET_S = 3.0
#: What each sim model claims of a node, and what a sleeping replica keeps of it.
CLAIM = 1 * GiB
WEIGHTS = 512 * MiB
#: How often a scenario reads the control plane's view while it waits: the resolution of
#: every "time to" figure read from the API (each read costs the API a few ms).
POLL_S = 0.1
#: The API client's timeout; the API answers in ms, but two busy cores stretch that.
API_TIMEOUT_S = 10.0
#: Event kind of a demand step (workflows/deployment.py records one per step).
DEMAND_EVENT = "deployment.demand"
#: The most events one read asks for: a scenario makes tens of steps.
EVENTS_LIMIT = 1000

#: The words that name the eviction protection window among the settings.
PROTECT_WORDS = ("evict", "protect")


def protection_setting() -> tuple[str, float] | None:
    """The eviction protection window: its environment variable and its default, looked
    up among the settings and tunables by name; None where there is none."""
    for model in (Settings, Tunables):
        for name, info in model.model_fields.items():
            if all(word in name for word in PROTECT_WORDS):
                return env_var_names(name)[0], float(info.default)
    return None


class DemandBenchError(RuntimeError):
    """A scenario could not go on: a status that never came, a refused call."""


def sim_model(model_id: str, **engine_args: Any) -> dict[str, Any]:
    """A sim model claiming :data:`CLAIM`, of which :data:`WEIGHTS` are weights."""
    return {"model_id": model_id, "engine": "sim", "source": "sim", "memory_bytes": CLAIM,
            "weights_bytes": WEIGHTS,
            "engine_args": {"memory_bytes": SIM_REAL_MEMORY,
                            "weights_bytes": SIM_REAL_WEIGHTS, **engine_args}}


@dataclass
class Stack:
    fleet: Fleet
    api: httpx.AsyncClient
    temporal: Client
    key: str

    @property
    def chat_url(self) -> str:
        return f"{self.fleet.gateway_url}/v1/chat/completions"

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        resp = await self.api.post(path, json=body)
        if resp.status_code not in (200, 201, 202):
            raise DemandBenchError(f"POST {path}: {resp.status_code} {resp.text[:400]}")
        result: dict[str, Any] = resp.json()
        return result

    async def deploy(self, model: dict[str, Any], scaling: dict[str, Any]) -> str:
        """Declare ``model`` and deploy it with ``scaling``; the deployment id."""
        await self.post("/models", model)
        made = await self.post("/deployments", {"model_id": model["model_id"],
                                                "scaling": scaling})
        await self._routed(model["model_id"])
        return str(made["deployment_id"])

    async def _routed(self, model_id: str) -> None:
        """Until the gateway lists ``model_id``: it learns a new deployment from the store's
        notification, milliseconds after the API's 201, and a request before that is a
        404 (an unknown model, which loads nothing)."""
        deadline = time.monotonic() + ROUTED_TIMEOUT_S
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    resp = await http.get(f"{self.fleet.gateway_url}/v1/models",
                                          headers={"Authorization": f"Bearer {self.key}"})
                    if resp.status_code == 200 and any(
                            m["id"] == model_id for m in resp.json()["data"]):
                        return
                if time.monotonic() > deadline:
                    raise DemandBenchError(f"the gateway never listed {model_id}")
                await asyncio.sleep(POLL_S)

    async def view(self, deployment_id: str) -> dict[str, Any] | None:
        try:
            resp = await self.api.get(f"/deployments/{deployment_id}")
        except httpx.HTTPError:
            return None  # a slow read on busy cores: the next poll asks again
        if resp.status_code != 200:
            return None
        found: dict[str, Any] = resp.json()
        return found

    async def wait_for(self, deployment_id: str, ok: Callable[[dict[str, Any]], bool], *,
                       what: str, timeout: float) -> float:
        """Poll until ``ok`` holds of the deployment's view; the seconds it took."""
        started = time.monotonic()
        last = "nothing read yet"
        while time.monotonic() - started < timeout:
            view = await self.view(deployment_id)
            if view is not None:
                if ok(view):
                    return time.monotonic() - started
                last = (f"{view['status']}, replicas "
                        f"{[r['state'] for r in view['replicas']]}")
            await asyncio.sleep(POLL_S)
        raise DemandBenchError(f"{deployment_id}: not {what} after {timeout:.0f}s ({last})")

    async def wait_status(self, deployment_id: str, *statuses: str, timeout: float) -> float:
        return await self.wait_for(deployment_id, lambda v: v["status"] in statuses,
                                   what=" or ".join(statuses), timeout=timeout)

    async def events(self, deployment_id: str | None = None,
                     kind: str | None = None) -> list[dict[str, Any]]:
        """The audit events (of one deployment, of one kind), oldest first, each with its
        wall-clock time as ``t`` (seconds since the epoch)."""
        params: dict[str, str | int] = {"limit": EVENTS_LIMIT}
        if deployment_id is not None:
            params["deployment_id"] = deployment_id
        found = (await self.api.get("/events", params=params)).raise_for_status().json()
        chosen = [e for e in found if kind is None or e["kind"] == kind]
        for event in chosen:
            event["t"] = datetime.fromisoformat(event["at"]).timestamp()
        return sorted(chosen, key=lambda e: float(e["t"]))

    async def history_length(self, deployment_id: str) -> tuple[str, int]:
        """The deployment workflow's current run and its history length."""
        view = await self.view(deployment_id)
        if view is None:
            raise DemandBenchError(f"{deployment_id}: the API did not answer")
        desc = await self.temporal.get_workflow_handle(view["workflow_id"]).describe()
        info = desc.raw_description.workflow_execution_info
        return info.execution.run_id, info.history_length

    async def quiet_history(self, deployment_id: str) -> tuple[str, int]:
        """The history length once it has stopped growing for QUIET_S: a step's last
        store writes and watch land after the status that shows it."""
        last = await self.history_length(deployment_id)
        while True:
            await asyncio.sleep(QUIET_S)
            now = await self.history_length(deployment_id)
            if now == last:
                return now
            last = now


def ready(view: dict[str, Any]) -> int:
    """Ready replicas in a deployment's view."""
    return sum(1 for r in view["replicas"] if r["state"] == "ready")
