"""The console's actions: scale, restart, switch, reconfigure, retry, delete, drain and
cordon. Each is the API route's own function, called with the operator the session
holds, after the checks of a change (session.acting_session: same origin, the CSRF
token, and the API's own verdict on that operator, method and path, a viewer's 403
included). So the rules, refusals and audit entries are the API's, word for word.

Each answers a fragment the page shows under its buttons: the operation it started
(which then follows its own steps live), or the API's refusal, with the API's status.
The pages ask for confirmation before sending (``hx-confirm``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from modelkeeper.domain.nodes import NodeUpdate
from modelkeeper.domain.operations import OperationRecord
from modelkeeper.domain.operators import Operator
from modelkeeper.domain.text import printable, unstorable

from .. import deployments, nodes, operations
from ..deps import SettingsDep, StoreDep, TemporalDep
from .render import page
from .session import PREFIX, LoginNeeded, acting_session

router = APIRouter(prefix=PREFIX, include_in_schema=False)

#: A form of the console's is a few fields; engine arguments a few hundred bytes.
MAX_FORM_BODY = 16_384


async def _form(request: Request) -> dict[str, str]:
    """The form's fields (urlencoded), the last of each name; a 422 for a field the store
    cannot hold, as the API's own bounds refuse it (api/limits.py)."""
    body = await request.body()
    if len(body) > MAX_FORM_BODY:
        raise HTTPException(413, f"the form sent {len(body)} bytes; at most {MAX_FORM_BODY}")
    fields = {k: v[-1] for k, v in parse_qs(body.decode(errors="replace"),
                                            keep_blank_values=True).items()}
    found = next(unstorable(fields, ("body",)), None)
    if found is not None:
        loc, problem, _ = found
        raise HTTPException(422, f"{'.'.join(printable(str(p)) for p in loc)} {problem}")
    return fields


def _int(fields: dict[str, str], name: str) -> int:
    try:
        return int(fields.get(name, ""))
    except ValueError:
        raise HTTPException(422, f"{name} must be a whole number; got "
                                 f"{fields.get(name, '')!r}") from None


async def _act(request: Request, *, method: str, path: str, what: str,
               call: Callable[[Operator, dict[str, str]], Awaitable[Any]]) -> Response:
    """Check the change, carry it out through the API's function, and answer what it
    started or why it was refused (the API's status and sentence)."""
    try:
        who = await acting_session(request, method=method, path=path)
        done = await call(who.operator, await _form(request))
    except LoginNeeded as needed:
        answer = page("result.html", session=None, status_code=401, what=what,
                      error=f"log in again: {needed.reason}", operation=None, done=None)
        answer.headers["HX-Redirect"] = f"{PREFIX}/login"
        return answer
    except HTTPException as refused:
        return page("result.html", session=None, status_code=refused.status_code,
                    what=what, error=_sentence(refused.detail), operation=None, done=None)
    except (RequestValidationError, ValidationError) as invalid:
        return page("result.html", session=None, status_code=422, what=what,
                    error="; ".join(_error(e) for e in invalid.errors()),
                    operation=None, done=None)
    if isinstance(done, JSONResponse):  # a scale-up refused for want of room, with plans
        detail = json.loads(bytes(done.body)).get("detail", "refused")
        return page("result.html", session=None, status_code=done.status_code, what=what,
                    error=_sentence(detail), operation=None, done=None)
    operation = done if isinstance(done, OperationRecord) else None
    return page("result.html", session=None, status_code=200, what=what, error=None,
                operation=operation, done=None if operation else _done(done))


def _sentence(detail: Any) -> str:
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        return "; ".join(_error(e) for e in detail if isinstance(e, dict))
    return str(detail)


def _error(error: Any) -> str:
    where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    return f"{where}: {error.get('msg', '')}" if where else str(error.get("msg", ""))


def _done(answer: Any) -> str:
    if isinstance(answer, str):
        return answer
    status = getattr(answer, "status", None)
    return f"accepted; the deployment is {getattr(status, 'value', status)}" if status \
        else "done"


# -- deployments -------------------------------------------------------------------------

@router.post("/deployments/{deployment_id}/scale")
async def scale(deployment_id: str, request: Request, store: StoreDep, *,
                temporal: TemporalDep, settings: SettingsDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        patch = operations.DeploymentPatch(replicas=_int(fields, "replicas"))
        return await deployments.scale_deployment(
            deployment_id, patch, store, temporal=temporal, response=Response(),
            operator=operator, settings=settings)
    return await _act(request, method="PATCH", path=f"/deployments/{deployment_id}",
                      what=f"scale {deployment_id}", call=call)


@router.post("/deployments/{deployment_id}/restart")
async def restart(deployment_id: str, request: Request, store: StoreDep,
                  temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        return await operations.restart_deployment(deployment_id, store, temporal,
                                                   operator=operator)
    return await _act(request, method="POST", path=f"/deployments/{deployment_id}/restart",
                      what=f"restart {deployment_id}", call=call)


@router.post("/deployments/{deployment_id}/switch")
async def switch(deployment_id: str, request: Request, store: StoreDep,
                 temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        wanted = operations.SwitchRequest.model_validate(
            {"model_id": fields.get("model_id", "")})
        return await operations.switch_deployment(deployment_id, wanted, store,
                                                  temporal=temporal, operator=operator)
    return await _act(request, method="POST", path=f"/deployments/{deployment_id}/switch",
                      what=f"switch {deployment_id}", call=call)


@router.post("/deployments/{deployment_id}/reconfigure")
async def reconfigure(deployment_id: str, request: Request, store: StoreDep,
                      temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        text = fields.get("engine_args", "")
        try:
            args = json.loads(text)
        except ValueError:
            raise HTTPException(422, f"engine_args must be a JSON object such as "
                                     f'{{"ctx_size": 4096}}; got {text[:200]!r}') from None
        if not isinstance(args, dict):
            raise HTTPException(422, f"engine_args must be a JSON object; got {text[:200]!r}")
        return await operations.start_reconfigure(deployment_id, args, store=store,
                                                  temporal=temporal, operator=operator)
    return await _act(request, method="POST",
                      path=f"/deployments/{deployment_id}/reconfigure",
                      what=f"reconfigure {deployment_id}", call=call)


@router.post("/deployments/{deployment_id}/retry")
async def retry(deployment_id: str, request: Request, store: StoreDep,
                temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        return await deployments.retry_deployment(deployment_id, store, temporal, operator)
    return await _act(request, method="POST", path=f"/deployments/{deployment_id}/retry",
                      what=f"retry {deployment_id}", call=call)


@router.post("/deployments/{deployment_id}/delete")
async def delete(deployment_id: str, request: Request, store: StoreDep,
                 temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        return await deployments.delete_deployment(deployment_id, store, temporal,
                                                   response=Response(), operator=operator)
    return await _act(request, method="DELETE", path=f"/deployments/{deployment_id}",
                      what=f"delete {deployment_id}", call=call)


# -- nodes -------------------------------------------------------------------------------

@router.post("/nodes/{node_id}/drain")
async def drain(node_id: str, request: Request, store: StoreDep,
                temporal: TemporalDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        grace = fields.get("grace_s", "").strip()
        wanted = operations.DrainRequest.model_validate(
            {"grace_s": grace} if grace else {})
        return await operations.drain_node(node_id, store, temporal, operator=operator,
                                           request=wanted)
    return await _act(request, method="POST", path=f"/nodes/{node_id}/drain",
                      what=f"drain {node_id}", call=call)


@router.post("/nodes/{node_id}/cordon")
async def cordon(node_id: str, request: Request, store: StoreDep, *,
                 temporal: TemporalDep, settings: SettingsDep) -> Response:
    async def call(operator: Operator, fields: dict[str, str]) -> Any:
        on = fields.get("cordoned", "true") == "true"
        info = await nodes.update_node(node_id, NodeUpdate(cordoned=on), store,
                                       temporal=temporal, settings=settings,
                                       operator=operator)
        return f"node {info.name} is {'cordoned' if on else 'uncordoned'}"
    return await _act(request, method="PATCH", path=f"/nodes/{node_id}",
                      what=f"cordon {node_id}", call=call)
