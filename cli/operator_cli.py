"""`modelkeeper deploy / ls / status / headroom / rm / nodes / explain / models / quota / size`,
the changes (`scale`, `owner`, `sleep`, `wake`, `retry`, `restart`, `switch`,
`reconfigure`, `cordon`, `uncordon`, `drain`, `hold`, `unhold`, `power-cap`),
`operations` (alias `ops`), which lists, shows and cancels the sagas, and `schedule`, a
deployment's windows of scaling by the clock: thin wrappers over the API, sending the
operator token (:func:`operator_token`). `tokens` makes, lists and revokes those tokens
straight in the database, so the first admin token needs no API.

One table, ``COMMANDS``, holds every operator command: its flags, the request it sends
(method, path and body, built from the parsed arguments alone) and how it shows the
answer. Tables for a person, ``--json`` for scripts.

Exit codes (``main`` in ``cli.py`` reads them off the two error types below):

- 0: done.
- 2 (``UsageError``): a user mistake, reported as one sentence naming the field, the value
  and the limit: a bad flag value, a malformed KEY=VALUE, a missing argument, a target that
  does not exist, or any 4xx from the API (404 unknown, 409 conflict, 422 invalid). Argparse
  exits 2 on its own for a flag it cannot parse.
- 1 (``ApiError``): the API failed, not the user: a 5xx, no answer (unreachable, timed
  out), or an answer that is not JSON. Retrying later may succeed; changing the command
  will not help.

Never a traceback for either.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from modelkeeper.domain.bounds import MAX_REPLICAS
from modelkeeper.domain.capacity import (
    MAX_OWNER_DEPTH,
    MAX_OWNER_LENGTH,
    MAX_QUOTA_REQUEST_BYTES,
    MAX_QUOTA_UNITS,
    OWNER_PATTERN,
    CapacityClass,
)
from modelkeeper.domain.catalog import DEFAULT_REPLICAS, scaling_summary
from modelkeeper.domain.demand import MAX_LOAD_WAIT_S, MAX_PERIOD_S, ScalingPolicy
from modelkeeper.domain.log_reads import DEFAULT_TAIL_LINES, FOLLOW_INTERVAL_S, MAX_TAIL_LINES
from modelkeeper.domain.no_room import MAX_PLAN_NUMBER, IfNoRoom
from modelkeeper.domain.operators import OperatorRole, name_problem
from modelkeeper.domain.shards import EngineKind
from modelkeeper.domain.status import failure_is_current
from modelkeeper.domain.topology import FACILITY_CAP_KEY
from modelkeeper.domain.units import format_duration, format_gib, parse_bytes, parse_duration
from modelkeeper.settings import Settings
from modelkeeper.store.tokens import OperatorTokenRecord, TokensStore

Out = Callable[[str], None]

#: What ``models add --source`` accepts (modelkeeper.domain.sources has the rules).
SOURCE_HELP = ("an absolute .gguf path under an allowed local root, an https URL on an "
               "allowed host, a Hugging Face repo id (org/name, read from the node's "
               "cache), 'smollm2' for the packaged SmolLM2, or, for the sim engine, any "
               "label (letters, digits, '.', '_', '-')")

#: ``events --follow`` shows this many past entries first (the newest), unless --limit.
EVENTS_FOLLOW_HISTORY = 10
#: The most past entries ``events`` asks for (GET /events' own bound).
MAX_EVENTS_SHOWN = 10_000
#: How long ``--wait`` waits by default: a deploy that downloads a few GB of weights.
DEFAULT_WAIT_TIMEOUT_S = 600.0

# A deploy waits while the API starts the deployment's workflow on Temporal; 30 s covers a
# Temporal server slow to answer, and still ends a call to an API that hangs.
API_TIMEOUT_S = 30


class UsageError(Exception):
    """A user mistake: one sentence naming the field, the value and the limit; exit 2."""

    exit_code = 2


class ApiError(Exception):
    """The API failed (5xx) or could not be reached; exit 1, since the command was sound."""

    exit_code = 1


def parse_pairs(items: Sequence[str], *, flag: str) -> dict[str, str]:
    """``["k=v", ...]`` as a dict: the one KEY=VALUE parser of the ``modelkeeper`` command.

    Raises ``UsageError`` naming ``flag`` and the item when one has no ``=`` or no key.
    """
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} {item!r} is not KEY=VALUE with a non-empty KEY")
        parsed[key] = value
    return parsed


# ----------------------------------------------------------------------------------------
# The requests


@dataclass(frozen=True)
class Request:
    """One call to the API.

    ``then`` turns the answer into what the command reports, or into the next request when
    a command needs two calls (``rm`` looks its target up first). Without it the answer is
    reported as it is.
    """

    method: str
    path: str
    body: dict[str, Any] | None = None
    params: dict[str, str] | None = None
    then: Callable[[Any], Any] | None = None


def execute(request: Request, http: httpx.Client) -> Any:
    """Send ``request`` and each follow-up it asks for; what the last one reports."""
    step: Any = request
    while isinstance(step, Request):
        answer = _send(http, step)
        step = answer if step.then is None else step.then(answer)
    return step


def _send(http: httpx.Client, request: Request) -> Any:
    try:
        resp = http.request(request.method, request.path, json=request.body,
                            params=request.params)
    except httpx.HTTPError as exc:
        raise ApiError(f"cannot reach the API at {http.base_url}: {exc}") from exc
    if 400 <= resp.status_code < 500:
        raise UsageError(f"{resp.status_code} {_detail(resp)}")
    if resp.status_code >= 500:
        raise ApiError(f"{resp.status_code} {_detail(resp)}")
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError as exc:
        raise ApiError(f"{request.method} {request.path} answered {resp.status_code} "
                       f"with non-JSON: {resp.text[:200]!r}") from exc


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        return resp.text
    if isinstance(detail, list):  # FastAPI validation errors
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
                         + (f" (got {d['input']!r})" if "input" in d else "") for d in detail)
    return str(detail)


@dataclass(frozen=True)
class PolicyFlag:
    """A flag of ``deploy`` and ``scale`` that sets one field of a scaling policy
    (modelkeeper.domain.demand.ScalingPolicy), with the bounds the API checks."""

    flag: str
    field: str
    #: A duration ("10m", "90s", "1h"; "off" where the field may be unset) or a count.
    duration: bool
    low: float
    high: float
    #: Whether ``low`` itself is allowed (a timeout of 0 is not).
    low_allowed: bool = True
    #: Whether "off" unsets it (never idle, never asleep).
    may_be_off: bool = False

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def parse(self, raw: Any) -> float | int | None:
        """The field's value from what was typed; a UsageError naming the flag, the value
        and the limit."""
        if self.duration:
            if self.may_be_off and raw == "off":
                return None
            try:
                value: float | int = parse_duration(raw)
            except ValueError as exc:
                raise UsageError(f"{self.flag} {raw!r}: {exc}") from None
            shown, low, high = raw, format_duration(self.low), format_duration(self.high)
        else:
            value = shown = raw
            low, high = f"{self.low:g}", f"{self.high:g}"
        if value > self.high or value < self.low or (value == self.low
                                                      and not self.low_allowed):
            floor = f"at least {low}" if self.low_allowed else f"above {low}"
            raise UsageError(f"{self.flag} {shown}: must be {floor} and at most {high}")
        return value


#: The policy flags, in the order they are shown; docs/demand.md says what each means.
POLICY_FLAGS = (
    PolicyFlag("--min", "min_replicas", duration=False, low=0, high=MAX_REPLICAS),
    PolicyFlag("--max", "max_replicas", duration=False, low=0, high=MAX_REPLICAS),
    PolicyFlag("--idle", "idle_timeout_s", duration=True, low=0, high=MAX_PERIOD_S,
               low_allowed=False, may_be_off=True),
    PolicyFlag("--sleep-after", "sleep_after_s", duration=True, low=0, high=MAX_PERIOD_S,
               low_allowed=False, may_be_off=True),
    PolicyFlag("--load-wait", "load_wait_s", duration=True, low=0, high=MAX_LOAD_WAIT_S),
    PolicyFlag("--standby", "warm_standby", duration=False, low=0, high=MAX_REPLICAS),
)


def _policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The scaling policy's fields the policy flags set, parsed and bounded; {} when none
    was given."""
    return {f.field: f.parse(getattr(args, f.dest)) for f in POLICY_FLAGS
            if getattr(args, f.dest) is not None}


def _given(args: argparse.Namespace) -> str:
    """The policy flags given, as typed: for a sentence."""
    return " ".join(f"{f.flag} {getattr(args, f.dest)}" for f in POLICY_FLAGS
                    if getattr(args, f.dest) is not None)


def _deploy_request(args: argparse.Namespace) -> Request:
    body: dict[str, Any] = {
        "model_id": args.model_id, "min_nodes": args.min_nodes, "node_ids": args.node_ids,
        "labels": parse_pairs(args.require_labels, flag="--require-label")}
    body.update(_room_fields(args))
    if args.owner is not None:
        body["owner"] = parse_scope(args.owner, flag="--owner")
    if args.capacity_class is not None:
        body["capacity_class"] = args.capacity_class
    policy = _policy_fields(args)
    if not policy:
        body["replicas"] = DEFAULT_REPLICAS if args.replicas is None else args.replicas
        return Request("POST", "/deployments", body=body)
    if args.replicas is not None:
        raise UsageError(f"give --replicas (a fixed count) or --min/--max (a policy), not "
                         f"both: --replicas {args.replicas} and {_given(args)} were given")
    missing = [flag for flag, field in (("--min", "min_replicas"), ("--max", "max_replicas"))
               if field not in policy]
    if missing:
        raise UsageError(f"{' and '.join(missing)} must be given with {_given(args)}: a "
                         "policy names its bounds (--min 0 --max 2 loads it on demand)")
    return Request("POST", "/deployments", body={**body, "scaling": policy})


def _room_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``if_no_room`` and ``plan`` as given (none: the API's default, queue)."""
    fields: dict[str, Any] = {}
    if args.if_no_room is not None:
        fields["if_no_room"] = args.if_no_room
    if args.plan is not None:
        if not 1 <= args.plan <= MAX_PLAN_NUMBER:
            raise UsageError(f"--plan {args.plan}: must be a plan's number, 1 to "
                             f"{MAX_PLAN_NUMBER} (a 409 lists them)")
        fields["plan"] = args.plan
    return fields


def _ls_request(args: argparse.Namespace) -> Request:
    return Request("GET", "/deployments")


def _status_request(args: argparse.Namespace) -> Request:
    return Request("GET", "/fleet")


def _headroom_request(args: argparse.Namespace) -> Request:
    """A deployment's headroom when ``target`` names one (by id or model id), else the
    catalog model's (the API answers 404 for neither)."""
    def then(deployments: list[dict[str, Any]]) -> Request:
        match = next((d for d in deployments
                      if args.target in (d["deployment_id"], d["model_id"])), None)
        if match is not None:
            return Request("GET", f"/deployments/{match['deployment_id']}/headroom")
        return Request("GET", f"/models/{args.target}/headroom")
    return Request("GET", "/deployments", then=then)


def _rm_request(args: argparse.Namespace) -> Request:
    return _on_deployment(args, lambda d: Request("DELETE", f"/deployments/{d}"))


def _on_deployment(args: argparse.Namespace, then: Callable[[str], Request]) -> Request:
    """Look ``args.target`` up by deployment id or model id, then send ``then(its id)``."""
    return Request("GET", "/deployments",
                   then=partial(_deployment_request, args.command, args.target, then))


def _deployment_request(command: str, target: str, then: Callable[[Any], Request],
                        deployments: list[dict[str, Any]], *, whole: bool = False) -> Request:
    """``then`` of the deployment whose id or model id is ``target``: of its id, or, with
    ``whole``, of the deployment as the API showed it."""
    match = next((d for d in deployments if target in (d["deployment_id"], d["model_id"])),
                 None)
    if match is None:
        known = ", ".join(sorted(d["model_id"] for d in deployments)) or "none"
        raise UsageError(f"{command} {target!r}: no deployment has that id or model id "
                         f"(deployed models: {known})")
    return then(match if whole else match["deployment_id"])


def _on_node(args: argparse.Namespace, then: Callable[[str], Request]) -> Request:
    """Look ``args.node`` up by node id or name, then send ``then(its id)``."""
    return Request("GET", "/nodes", then=partial(_node_request, args.command, args.node, then))


def _node_request(command: str, target: str, then: Callable[[str], Request],
                  nodes: list[dict[str, Any]]) -> Request:
    """``then`` of the node whose id or name is ``target``. An id wins (ids are unique);
    a name two nodes share (registered before names were unique) is refused, listing
    both, since acting on either would be a guess."""
    match = next((n for n in nodes if n["node_id"] == target), None)
    if match is None:
        named = [n for n in nodes if n["name"] == target]
        if len(named) > 1:
            ids = ", ".join(sorted(n["node_id"] for n in named))
            raise UsageError(f"{command} {target!r}: {len(named)} nodes have that name "
                             f"({ids}); give the id of the one you mean")
        match = named[0] if named else None
    if match is None:
        known = ", ".join(sorted(n["name"] for n in nodes)) or "none"
        raise UsageError(f"{command} {target!r}: no node has that id or name "
                         f"(nodes: {known})")
    return then(match["node_id"])


def _scale_request(args: argparse.Namespace) -> Request:
    if None not in (args.replicas, args.count) and args.replicas != args.count:
        raise UsageError(f"give the count once: N {args.count} and --replicas "
                         f"{args.replicas} were given")
    count = args.count if args.replicas is None else args.replicas
    policy = _policy_fields(args)
    if count is not None and policy:
        raise UsageError(f"give --replicas (a fixed count) or policy flags, not both: "
                         f"--replicas {count} and {_given(args)} were given")
    room = _room_fields(args)
    if room and count is None:
        raise UsageError("--if-no-room and --plan go with a replica count (a scale-up)")
    if count is not None:
        return _on_deployment(args, lambda d: Request("PATCH", f"/deployments/{d}",
                                                      body={"replicas": count, **room}))
    if not policy:
        raise UsageError("give --replicas N (a fixed count) or policy flags ("
                         + ", ".join(f.flag for f in POLICY_FLAGS) + ")")
    return Request("GET", "/deployments", then=partial(
        _deployment_request, args.command, args.target,
        lambda d: Request("PATCH", f"/deployments/{d['deployment_id']}",
                          body={"scaling": _merged_policy(d, policy)}), whole=True))


def _merged_policy(deployment: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The deployment's policy with ``fields`` over it: a flag not given keeps its value
    (a fixed deployment's is min = max = its count)."""
    current = deployment.get("scaling") or {"min_replicas": deployment["desired_replicas"],
                                            "max_replicas": deployment["desired_replicas"]}
    return {**current, **fields}


def _sleep_request(args: argparse.Namespace) -> Request:
    body = None if args.replica is None else {"replica_id": args.replica}
    return _on_deployment(args, lambda d: Request("POST", f"/deployments/{d}/{args.command}",
                                                  body=body))


def _retry_request(args: argparse.Namespace) -> Request:
    return _on_deployment(args, lambda d: Request("POST", f"/deployments/{d}/retry"))


def _restart_request(args: argparse.Namespace) -> Request:
    return _on_deployment(args, lambda d: Request("POST", f"/deployments/{d}/restart"))


def _switch_request(args: argparse.Namespace) -> Request:
    return _on_deployment(args, lambda d: Request("POST", f"/deployments/{d}/switch",
                                                  body={"model_id": args.model_id}))


def _reconfigure_request(args: argparse.Namespace) -> Request:
    # Parsed before any request: a malformed pair never reaches the API.
    engine_args = _engine_args(args.engine_args, flag="engine argument")
    return _on_deployment(args, lambda d: Request("POST", f"/deployments/{d}/reconfigure",
                                                  body={"engine_args": engine_args}))


def _cordon_request(args: argparse.Namespace) -> Request:
    body: dict[str, Any] = {"cordoned": True}
    if args.reason is not None:
        body["cordon_reason"] = args.reason
    return _on_node(args, lambda n: Request("PATCH", f"/nodes/{n}", body=body))


def _uncordon_request(args: argparse.Namespace) -> Request:
    return _on_node(args, lambda n: Request("PATCH", f"/nodes/{n}", body={"cordoned": False}))


def _hold_request(args: argparse.Namespace) -> Request:
    if args.capacity_class is None and args.owner is None:
        raise UsageError(f"hold {args.node}: give --class, --owner or both (what the node is "
                         "kept for); `unhold` releases a hold")
    body: dict[str, Any] = {}
    if args.capacity_class is not None:
        body["hold_class"] = args.capacity_class
    if args.owner is not None:
        body["hold_owner"] = parse_scope(args.owner, flag="--owner")
    return _on_node(args, lambda n: Request("PATCH", f"/nodes/{n}", body=body))


def _unhold_request(args: argparse.Namespace) -> Request:
    return _on_node(args, lambda n: Request("PATCH", f"/nodes/{n}",
                                            body={"release_hold": True}))


def _power_cap_request(args: argparse.Namespace) -> Request:
    if args.action == "ls":
        return Request("GET", "/power-caps")
    if args.pdu is None:
        raise UsageError(f"power-cap {args.action} needs a PDU (a node's topology.pdu label, "
                         f"or {FACILITY_CAP_KEY} for the whole facility), and none was given")
    if args.action == "rm":
        return Request("DELETE", f"/power-caps/{args.pdu}")
    if args.watts is None:
        raise UsageError(f"power-cap set {args.pdu}: WATTS is missing (the most the PDU's "
                         "nodes may draw together)")
    return Request("PUT", f"/power-caps/{args.pdu}", body={"watts": args.watts})


def _drain_request(args: argparse.Namespace) -> Request:
    body: dict[str, Any] = {"uncordon_on_cancel": args.uncordon_on_cancel}
    if args.grace is not None:
        body["grace_s"] = args.grace
    return _on_node(args, lambda n: Request("POST", f"/nodes/{n}/drain", body=body))


def _operations_request(args: argparse.Namespace) -> Request:
    if args.action == "ls":
        params = {k: str(v) for k, v in (("deployment", args.deployment), ("node", args.node),
                                         ("state", args.state), ("limit", args.limit))
                  if v is not None}
        return Request("GET", "/operations", params=params or None)
    if not args.operation_id:
        raise UsageError(f"operations {args.action} needs an operation id such as restart/d1/1, "
                         "and none was given (modelkeeper operations lists them)")
    if args.action == "show":
        return Request("GET", f"/operations/{args.operation_id}")
    return Request("POST", f"/operations/{args.operation_id}/cancel")


def _nodes_request(args: argparse.Namespace) -> Request:
    if args.action != "rm":
        return Request("GET", "/nodes")
    if args.node is None:
        raise UsageError("nodes rm: NODE is missing: name the id or name of the node to "
                         "remove")
    params = {"force": "true"} if args.force else None
    return Request("GET", "/nodes", then=partial(
        _node_request, "nodes rm", args.node,
        lambda node_id: Request("DELETE", f"/nodes/{node_id}", params=params)))


def _size_request(args: argparse.Namespace) -> Request:
    if not args.rps > 0:
        raise UsageError(f"--rps {args.rps:g}: a target rate must be above 0 requests/s")
    params = {"rps": str(args.rps)}
    if args.profile is not None:
        params["profile"] = args.profile
    return Request("GET", f"/models/{args.model_id}/size", params=params)


def _explain_request(args: argparse.Namespace) -> Request:
    """Of a model, or (``--deployment``, by id or model id) of a deployment's next
    replica: its labels, nodes and class apply."""
    if args.deployment is None:
        if args.model_id is None:
            raise UsageError("explain needs a MODEL or --deployment DEPLOYMENT, and neither "
                             "was given")
        return Request("GET", "/placement/explain", params={"model_id": args.model_id})
    extra = {} if args.model_id is None else {"model_id": args.model_id}
    return Request("GET", "/deployments", then=partial(
        _deployment_request, args.command, args.deployment,
        lambda d: Request("GET", "/placement/explain",
                          params={"deployment_id": d, **extra})))


def _models_request(args: argparse.Namespace) -> Request:
    if args.action == "ls":
        return Request("GET", "/models")
    if not args.model_id:
        raise UsageError(f"models {args.action} needs a MODEL_ID, and none was given")
    if args.action == "rm":
        return Request("DELETE", f"/models/{args.model_id}",
                       then=partial(_removed, args.model_id))
    if args.action == "show":
        return Request("GET", f"/models/{args.model_id}")
    if args.action == "edit":
        return _model_edit_request(args)
    if args.apply:
        raise UsageError(f"--apply goes with models edit (it restarts the deployments of "
                         f"the changed model), not models {args.action}")
    if not args.engine:
        raise UsageError(f"models add {args.model_id!r}: --engine is required, one of "
                         f"{', '.join(EngineKind)}")
    if not args.source:
        raise UsageError(f"models add {args.model_id!r}: --source is required: "
                         f"{SOURCE_HELP}")
    model: dict[str, Any] = {"model_id": args.model_id, "engine": args.engine,
                             "source": args.source,
                             "engine_args": _engine_args(args.engine_args)}
    for field in ("default_max_tokens", "max_tokens_limit", "engine_version", "gpus",
                  "min_nodes"):
        if getattr(args, field, None) is not None:
            model[field] = getattr(args, field)
    for flag, field in (("memory", "memory_bytes"), ("weights", "weights_bytes")):
        if getattr(args, flag, None):
            try:
                model[field] = parse_bytes(getattr(args, flag))
            except ValueError as exc:
                raise UsageError(f"--{flag}: {exc}") from exc
    if getattr(args, "profiles", None):
        model["profiles"] = _profiles_file(args.profiles)
    return Request("POST", "/models", body=model)


def _model_edit_request(args: argparse.Namespace) -> Request:
    """``models edit``: PATCH /models/ID with the parts given (engine arguments laid over
    the model's, which it reads first), then, with ``--apply``, a restart of each
    deployment serving it (:func:`_apply_change`)."""
    for flag in ("engine", "profiles", "weights", "default_max_tokens", "max_tokens_limit",
                 "gpus", "min_nodes", "engine_version"):
        if getattr(args, flag, None) not in (None, [], False):
            raise UsageError(f"models edit: --{flag.replace('_', '-')} cannot change: a "
                             "model's memory (--memory), engine arguments (--engine-arg, "
                             "--unset-engine-arg), source (--source) and sha256 (--sha256) "
                             "can; for anything else add a new model and switch to it")
    patch: dict[str, Any] = {}
    if args.memory:
        try:
            patch["memory_bytes"] = parse_bytes(args.memory)
        except ValueError as exc:
            raise UsageError(f"--memory: {exc}") from exc
    if args.source:
        patch["source"] = args.source
    if args.sha256 is not None:
        patch["sha256"] = None if args.sha256 == "none" else args.sha256
    given = _engine_args(args.engine_args)
    unset = list(args.unset_engine_args)
    if not patch and not given and not unset:
        raise UsageError(f"models edit {args.model_id!r}: give what changes: --memory, "
                         "--engine-arg KEY=VALUE, --unset-engine-arg KEY, --source or "
                         "--sha256")
    path = f"/models/{args.model_id}"

    def send(engine_args: dict[str, Any] | None) -> Request:
        body = patch if engine_args is None else {**patch, "engine_args": engine_args}
        return Request("PATCH", path, body=body,
                       then=_apply_change if args.apply else None)

    if not given and not unset:
        return send(None)

    def merged(model: dict[str, Any]) -> Request:
        current = dict(model.get("engine_args") or {})
        missing = [k for k in unset if k not in current]
        if missing:
            raise UsageError(f"--unset-engine-arg {missing[0]}: model {args.model_id!r} has "
                             f"no such engine argument (it has: "
                             f"{', '.join(sorted(current)) or 'none'})")
        for key in unset:
            del current[key]
        return send({**current, **given})
    return Request("GET", path, then=merged)


def _apply_change(answer: dict[str, Any]) -> Request | dict[str, Any]:
    """After a change: a restart of each deployment serving the model, one after the
    other, each answer kept in ``operations``; the change itself when none serves it."""
    answer = {**answer, "operations": []}
    return _next_restart(answer, list(answer["deployments"]), None)


def _next_restart(answer: dict[str, Any], todo: list[str],
                  started: dict[str, Any] | None) -> Request | dict[str, Any]:
    if started is not None:
        answer["operations"].append(started)
    if not todo:
        return answer
    return Request("POST", f"/deployments/{todo[0]}/restart",
                   then=partial(_next_restart, answer, todo[1:]))


def _profiles_file(path: str) -> Any:
    """``models add --profiles FILE``: the JSON list of hardware profiles in FILE, as
    POST /models takes it (the API judges each field and names the one it refuses)."""
    try:
        with open(path, encoding="utf-8") as file:
            profiles = json.load(file)
    except OSError as exc:
        raise UsageError(f"--profiles {path}: cannot be read ({exc.strerror})") from exc
    except ValueError as exc:
        raise UsageError(f"--profiles {path}: not JSON ({exc})") from exc
    if not isinstance(profiles, list):
        raise UsageError(f"--profiles {path}: must hold a JSON list of profiles, not "
                         f"{type(profiles).__name__}")
    return profiles


def parse_scope(value: str, *, flag: str) -> str:
    """A scope of the tenancy tree as typed; a UsageError naming ``flag``, the value and
    the rule."""
    if len(value) > MAX_OWNER_LENGTH or re.fullmatch(OWNER_PATTERN, value) is None:
        raise UsageError(f"{flag} {value!r}: a scope is org, org/team or org/team/project, "
                         f"each part 1 to 63 lowercase letters, digits, '-' or '_' "
                         f"(starting and ending with a letter or digit), at most "
                         f"{MAX_OWNER_DEPTH} parts")
    return value


@dataclass(frozen=True)
class QuotaFlag:
    """A flag of ``quota set``: one part of the guarantee or the limit."""

    flag: str
    #: "guarantee" or "limit".
    side: str
    #: The part's field in Resources and Limit.
    field: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def parse(self, raw: str) -> int | float:
        """The part's value from what was typed; a UsageError naming the flag, the value
        and the limit."""
        if self.field == "memory_bytes":
            try:
                value: int | float = parse_bytes(raw)
            except ValueError as exc:
                raise UsageError(f"{self.flag}: {exc}") from None
            high: int | float = MAX_QUOTA_REQUEST_BYTES
            shown = format_gib(MAX_QUOTA_REQUEST_BYTES)
        else:
            try:
                value = int(raw) if self.field == "gpus" else float(raw)
            except ValueError:
                kind = "a whole number" if self.field == "gpus" else "a number"
                raise UsageError(f"{self.flag} {raw!r}: must be {kind}") from None
            high, shown = MAX_QUOTA_UNITS, f"{MAX_QUOTA_UNITS:,}"
        if not 0 <= value <= high:
            raise UsageError(f"{self.flag} {raw}: must be at least 0 and at most {shown}")
        return value


QUOTA_FLAGS = tuple(QuotaFlag(f"--{side}-{name}", side, field)
                    for side in ("guarantee", "limit")
                    for name, field in (("memory", "memory_bytes"), ("gpus", "gpus"),
                                        ("cores", "cpu_cores")))


def _quota_request(args: argparse.Namespace) -> Request:
    if args.action == "ls":
        return Request("GET", "/quotas")
    if not args.scope:
        raise UsageError(f"quota {args.action} needs a SCOPE, and none was given")
    scope = parse_scope(args.scope, flag="SCOPE")
    if args.action == "rm":
        return Request("DELETE", f"/quotas/{scope}", then=partial(_quota_removed, scope))
    body: dict[str, dict[str, int | float]] = {"guarantee": {}, "limit": {}}
    for flag in QUOTA_FLAGS:
        raw = getattr(args, flag.dest)
        if raw is not None:
            body[flag.side][flag.field] = flag.parse(raw)
    if not body["guarantee"] and not body["limit"]:
        raise UsageError(f"quota set {scope}: give at least one of "
                         + ", ".join(f.flag for f in QUOTA_FLAGS))
    return Request("PUT", f"/quotas/{scope}", body=body)


def _quota_removed(scope: str, _answer: None) -> dict[str, Any]:
    return {"scope": scope, "removed": True}


def _owner_request(args: argparse.Namespace) -> Request:
    scope = parse_scope(args.scope, flag="SCOPE")
    return _on_deployment(args, lambda d: Request("PATCH", f"/deployments/{d}",
                                                  body={"owner": scope}))


#: ``schedule add --days``: days, and ranges that may wrap past Sunday (fri-mon).
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_DAYS_ACCEPTED = "days mon..sun, comma-separated, with ranges (mon-fri, sat-sun, fri-mon)"
#: ``schedule add --prewarm``: a number of seconds, or with a unit.
_PREWARM_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}
_PREWARM_ACCEPTED = "whole seconds, or a whole number with s, m or h (e.g. 90s, 5m, 1h)"


def parse_days(value: str) -> list[str]:
    """``mon-fri`` or ``mon,wed,fri`` or ``fri-mon`` as the day names, Monday first.
    Raises ``UsageError`` naming ``--days``, the value and what is accepted."""
    days: set[str] = set()
    for item in value.lower().split(","):
        first, _, last = item.strip().partition("-")
        if first not in DAY_NAMES or (last and last not in DAY_NAMES):
            raise UsageError(f"--days {value!r}: {item.strip()!r} is not a day or a range "
                             f"of days; expected {_DAYS_ACCEPTED}")
        i, j = DAY_NAMES.index(first), DAY_NAMES.index(last or first)
        days.update(DAY_NAMES[(i + k) % 7] for k in range((j - i) % 7 + 1))
    return [d for d in DAY_NAMES if d in days]


def parse_prewarm(value: str) -> int:
    """``5m`` as 300; ``UsageError`` naming ``--prewarm`` otherwise."""
    text = value.strip().lower()
    unit = text[-1] if text and text[-1].isalpha() else ""
    number = text.removesuffix(unit)
    if unit not in _PREWARM_UNITS or not number.isdigit():
        raise UsageError(f"--prewarm {value!r}: expected {_PREWARM_ACCEPTED}")
    return int(number) * _PREWARM_UNITS[unit]


def _windows_path(deployment_id: str) -> str:
    return f"/deployments/{deployment_id}/windows"


def _schedule_request(args: argparse.Namespace) -> Request:
    if args.action == "ls":
        return _on_deployment(args, lambda d: Request("GET", _windows_path(d)))
    if args.action == "rm":
        name = args.name or args.window
        if not name:
            raise UsageError("schedule rm needs the window's NAME (schedule ls DEPLOYMENT "
                             "lists them), and none was given")
        return _on_deployment(args, lambda d: Request(
            "DELETE", f"{_windows_path(d)}/{name}", then=partial(_window_removed, d, name)))
    missing = [flag for flag, given in (("--name", args.name), ("--days", args.days),
                                        ("--start", args.start), ("--end", args.end),
                                        ("--tz", args.tz), ("--min", args.min),
                                        ("--max", args.max)) if given is None]
    if missing:
        raise UsageError(f"schedule add {args.target!r}: {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} required, e.g. --name day "
                         "--days mon-fri --start 08:00 --end 18:00 --tz Europe/Berlin "
                         "--min 2 --max 4 --prewarm 5m")
    # Parsed before any request: a malformed --days never reaches the API.
    window = {"name": args.name, "days": parse_days(args.days), "start": args.start,
              "end": args.end, "timezone": args.tz, "min_replicas": args.min,
              "max_replicas": args.max,
              "prewarm_s": parse_prewarm(args.prewarm) if args.prewarm else 0}
    return _on_deployment(args, lambda d: Request("POST", _windows_path(d), body=window))


def _window_removed(deployment_id: str, name: str, _answer: None) -> dict[str, Any]:
    """What ``schedule rm`` reports: the API answers 204, with no body."""
    return {"deployment_id": deployment_id, "name": name, "removed": True}


def _removed(model_id: str, _answer: None) -> dict[str, Any]:
    """What ``models rm`` reports: the API answers 204, with no body."""
    return {"model_id": model_id, "deleted": True}


def _engine_args(items: Sequence[str], *, flag: str = "--engine-arg") -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for key, value in parse_pairs(items, flag=flag).items():
        try:
            parsed[key] = json.loads(value)  # numbers and booleans keep their type
        except ValueError:
            parsed[key] = value
    return parsed


def _events_request(args: argparse.Namespace) -> Request:
    if args.follow and args.limit is None:
        args.limit = EVENTS_FOLLOW_HISTORY
    if args.limit is not None and not 1 <= args.limit <= MAX_EVENTS_SHOWN:
        raise UsageError(f"--limit {args.limit}: must be 1 to {MAX_EVENTS_SHOWN:,} (the "
                         "newest entries shown)")
    params = {name: str(value) for name in ("deployment", "node", "kind", "limit")
              if (value := getattr(args, name)) is not None}
    return Request("GET", "/events", params=params or None)


# ----------------------------------------------------------------------------------------
# The renderers: text for a person (``--json`` prints the answer as it is)


def table(rows: list[list[str]], headers: list[str]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


#: The narrowest and widest a long free-text cell of a table (an operation's summary or
#: error) is cut to: a sentence of a summary stays whole even on a narrow terminal, and
#: one of 600 characters is one line on a wide one.
MIN_CELL_CHARS = 60
MAX_CELL_CHARS = 120
#: The ellipsis a cut cell ends with.
ELLIPSIS = "…"


def clip(text: str, width: int) -> str:
    """``text`` on one line of at most ``width`` characters: newlines become spaces, and
    a longer one is cut, ending with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:max(width - 1, 0)].rstrip() + ELLIPSIS


def cell_width() -> int:
    """How wide a long cell may be: half the terminal (the rest of its row beside it),
    within MIN_CELL_CHARS and MAX_CELL_CHARS; the widest when not a terminal (a file or a
    pipe has no width, and a line of 600 characters is still cut)."""
    columns = shutil.get_terminal_size((2 * MAX_CELL_CHARS, 24)).columns
    return max(MIN_CELL_CHARS, min(MAX_CELL_CHARS, columns // 2))


def _mem(value: int | None) -> str:
    return "-" if value is None else format_gib(value)


def _reason(deployment: dict[str, Any]) -> str:
    """Why a deployment is not serving. A serving or stopped one (stopped: scaled to 0 by
    an operator, not by a failure) shows its last failure only as history, marked so."""
    last = deployment["last_failure"]
    match deployment["status"]:
        case "cant_place":
            return str(deployment["placement_error"] or "")
        case "degraded":
            # The keeper's reason names the unreachable replica and its nodes.
            reason = str(last or "a replica is unreachable")
            if deployment["placement_error"]:
                reason += f"; its replacement cannot be placed: {deployment['placement_error']}"
            return reason
        case "serving" | "stopped" | "idle" | "sleeping":
            # Only while it belongs to what runs now: a restart (or switch, reconfigure)
            # since has replaced what failed.
            current = failure_is_current(deployment.get("last_failure_generation"),
                                         deployment.get("generation", 0))
            return f"(last failure: {last})" if last and current else ""
        case "loading":
            # Who asked and since when (the keeper's reason, e.g. "3 request(s) waiting").
            since = deployment.get("loading_since")
            reason = str(deployment.get("loading_reason") or "asked for")
            return f"{reason} (since {since})" if since else reason
        case _:
            return str(last or "")


def event_line(event: dict[str, Any]) -> str:
    """One audit entry for a person: time (UTC), kind, deployment/node/replica, message."""
    at = str(event["at"]).replace("T", " ")[:19] + "Z"
    where = "/".join(x for x in (event.get("deployment_id"), event.get("node_id"),
                                 event.get("replica_id")) if x) or "-"
    return f"{at}  {event['kind']:<24} {where:<20} {event['message']}"


def _events_text(args: argparse.Namespace, result: Any) -> str:
    return "\n".join(event_line(e) for e in result) if result else "(no events)"


def _events_json(args: argparse.Namespace, result: Any) -> str:
    """JSON lines, one entry each, as ``--follow`` goes on printing them."""
    return "\n".join(json.dumps(e, default=str) for e in result)


def _deploy_text(args: argparse.Namespace, result: Any) -> str:
    return (f"deployment {result['deployment_id']} of {result['model_id']}: "
            f"{result['status']} (workflow {result['workflow_id']})")


def _notes(deployment: dict[str, Any]) -> str:
    """What an operator should know beside the status: the model behind the served name
    after a switch, the hardware profiles its replicas run, replicas on an older
    generation (outdated: a restart, switch or reconfigure has not reached them), replicas
    that had to share a node, and the last demand step."""
    notes = []
    runs = deployment.get("runs_model_id")
    if runs and runs != deployment["model_id"]:
        notes.append(f"runs {runs}")
    # The hardware profiles its replicas run, so a fallback (llama.cpp on CPU where vLLM
    # was wanted) is seen without asking for each replica.
    profiles = sorted({r["profile"] for r in deployment.get("replicas", [])
                       if r.get("profile")})
    if profiles:
        notes.append(f"profile {', '.join(profiles)}")
    # A start's progress on its node: the download (bytes, %, rate), its place in the
    # start-up queue and whom it waits for, the engine loading.
    notes += [f"{r['replica_id']} {r['progress']['summary']}"
              for r in deployment.get("replicas", []) if r.get("progress")]
    # A multi-node replica loading: how many of its shards are ready.
    notes += [f"{r['replica_id']} loading, {r['shards_ready']}/{len(r['nodes'])} shards ready"
              for r in deployment.get("replicas", []) if r.get("shards_ready") is not None]
    stale = [r["replica_id"] for r in deployment.get("replicas", []) if r.get("outdated")]
    if stale:
        notes.append(f"outdated: {', '.join(stale)}")
    if deployment.get("placement_note"):
        notes.append(str(deployment["placement_note"]))
    if deployment.get("demand_note"):
        # The last demand step and why, an eviction's reason included.
        notes.append(str(deployment["demand_note"]))
    return "; ".join(notes)


def _policy(deployment: dict[str, Any]) -> str:
    """The scaling policy in force, e.g. ``0-2 idle 10m``; ``-`` when fixed."""
    scaling = deployment.get("scaling")
    return scaling_summary(None if scaling is None else ScalingPolicy(**scaling))


def _ready(deployment: dict[str, Any]) -> str:
    """Ready of wanted, and the replicas asleep (kept on purpose, woken when asked for)."""
    shown = f"{deployment['ready_replicas']}/{deployment['desired_replicas']}"
    asleep = sum(1 for r in deployment.get("replicas", []) if r.get("state") == "sleeping")
    return f"{shown} +{asleep} asleep" if asleep else shown


def _ls_text(args: argparse.Namespace, result: Any) -> str:
    # shown_status: `queued` while every start waits at its node's start-up gate.
    return table([[d["deployment_id"], d["model_id"], d.get("shown_status") or d["status"],
                   _ready(d), _policy(d),
                   str(d["consecutive_failures"]),
                   "; ".join(x for x in (_reason(d), _notes(d)) if x)] for d in result],
                 ["id", "model", "status", "ready", "policy", "failures", "reason"])


def _rm_text(args: argparse.Namespace, result: Any) -> str:
    return f"deployment {result['deployment_id']}: {result['status']}"


#: Marks a node whose real available memory (AVAIL) is below the memory placement
#: counts as free (FREE: declared minus claimed), and the line under the table that says
#: what the mark means.
OVERPROMISED = "!"
OVERPROMISED_LEGEND = (f"{OVERPROMISED} promises more than it has: AVAIL (free on the "
                       "machine now, as its agent last saw it) is below FREE (declared "
                       "minus what replicas claim), which placement counts on")


def _overpromised(node: dict[str, Any]) -> bool:
    """Whether the node has less memory available than it offers placement."""
    avail, free = node.get("memory_available_bytes"), node["memory_free_bytes"]
    return avail is not None and free is not None and avail < free


def _nodes_text(args: argparse.Namespace, result: Any) -> str:
    if args.action == "rm":
        held = sum(len(ids) for ids in result["replicas"].values())
        return (f"node {result['name']} ({result['node_id']}): removed"
                + (f"; its {held} replica(s) will be placed elsewhere" if held else ""))
    shown = table([[n["name"], n["node_id"], n["state"], _mem(n["memory_total_bytes"]),
                    _mem(n["memory_claimed_bytes"]), _mem(n["memory_free_bytes"]),
                    _mem(n.get("memory_available_bytes"))
                    + (OVERPROMISED if _overpromised(n) else ""),
                    "-" if n["cpu_count"] is None else str(n["cpu_count"]),
                    n.get("memory_level", "ok"), _held_for(n), _engines(n),
                    ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())),
                    n["last_seen"]] for n in result],
                  ["name", "id", "state", "memory", "claimed", "free", "avail", "cpus",
                   "level", "held for", "engines", "labels", "last seen"])
    if any(_overpromised(n) for n in result):
        shown += "\n" + OVERPROMISED_LEGEND
    return shown


def _explain_text(args: argparse.Namespace, result: Any) -> str:
    # The chosen nodes come as ids; every table shows names.
    names = {n.get("node_id"): n["name"] for n in result["nodes"]}
    chosen = ", ".join(names.get(i, i) for i in result["nodes_chosen"])
    profile = f" (profile {result['profile']})" if result.get("profile") else ""
    what = result["model_id"] + (f" (deployment {result['deployment_id']})"
                                 if result.get("deployment_id") else "")
    head = (f"{what}: fits on {chosen}{profile}"
            if result["fits"] else f"{what}: cannot be placed: {result['summary']}")
    if result.get("note"):
        head += f"\n{result['note']}"
    if result.get("calibration"):
        head += f"\nOOM calibration: {result['calibration']['note']}"
    return head + "\n" + table([[n["name"], "yes" if n["fits"] else "no", n["message"]]
                                for n in result["nodes"]], ["node", "fits", "why"])


def _models_text(args: argparse.Namespace, result: Any) -> str:
    match args.action:
        case "ls":
            return table([[m["model_id"], m["engine"], m["source"],
                           _mem(m["memory_bytes"]) + (" (estimated)" if m["memory_estimated"]
                                                      else ""),
                           str(m["min_nodes"])] for m in result],
                         ["model", "engine", "source", "memory", "min nodes"])
        case "rm":
            return f"model {result['model_id']} removed"
        case "show":
            return _model_text(result)
        case "edit":
            return _model_changed_text(args, result)
        case _:
            return f"model {result['model_id']} added ({_mem(result['memory_bytes'])})"


def _model_changed_text(args: argparse.Namespace, result: dict[str, Any]) -> str:
    """``models edit``: what changed, which deployments run the old spec, and the
    restarts ``--apply`` started."""
    model = result["model"]["model_id"]
    if not result["changes"]:
        return f"model {model}: nothing changed (it already has these values)"
    lines = [f"model {model} changed: {'; '.join(result['changes'])}"]
    named, count = result["deployments"], result["deployment_count"]
    more = f" and {count - len(named)} more" if count > len(named) else ""
    operations = result.get("operations")
    if not named:
        lines.append("no deployment serves it: new replicas run the new spec")
    elif operations is None:
        lines.append(f"deployments serving it: {', '.join(named)}{more}; their replicas run "
                     f"the old spec (outdated in ls) until restarted: modelkeeper restart "
                     f"DEPLOYMENT, or models edit {model} ... --apply")
    else:
        lines.append("rolling it out: a restart of each deployment serving it"
                     + (f" ({count - len(named)} more not restarted: restart them by name)"
                        if more else ""))
        lines += [_started_text(args, o) for o in operations]
    return "\n".join(lines)


def measured_line(m: dict[str, Any]) -> str:
    """One measured capacity (modelkeeper.domain.measured.MeasuredCapacity), as a line."""
    per = ("" if m.get("unit") is None else
           f", {m['tokens_per_s_per_unit']:.1f} tokens/s per {m['unit']}")
    objective = m["objective"]
    return (f"{m['concurrency']} concurrent request(s) per replica, "
            f"{m['tokens_per_s']:.1f} tokens/s{per}, within TTFT p95 "
            f"{objective['ttft_p95_s']:g} s and inter-token p95 {objective['itl_p95_s']:g} s "
            f"(measured {m['measured_at']}, {m['max_tokens']} max_tokens, "
            f"{m['mean_request_s']:.2f} s mean request)")


def _model_text(m: dict[str, Any]) -> str:
    lines = [f"model {m['model_id']}: {m['engine']}, {m['source']}, "
             f"{_mem(m['memory_bytes'])}" + (" (estimated)" if m["memory_estimated"] else "")
             + (f", {m['gpus']} GPU(s)" if m.get("gpus") else "")
             + (f", {m['cpu_cores']:g} core(s)" if m.get("cpu_cores") else "")]
    measured = m.get("measured") or []
    if not measured:
        lines.append("  measured: never (modelkeeper bench MODEL measures it)")
    for entry in measured:
        profile = entry["profile"] or "(own resources)"
        lines.append(f"  measured as {profile}: {measured_line(entry)}")
    return "\n".join(lines)


def _size_text(args: argparse.Namespace, r: Any) -> str:
    room = ("there is room for them now" if r["enough_room"] else
            f"only {r['fit_now']} more fit now")
    more = (f"{r['more_needed']} more than the {r['replicas_now']} there are; {room}"
            if r["more_needed"] else f"it has {r['replicas_now']}: enough")
    return (f"{r['model_id']} at {r['rps']:g} req/s needs {r['replicas_needed']} "
            f"replica(s) ({r['per_replica_rps']:g} req/s each): {more}\n"
            f"  how: {r['assumption']}")


def _scale_text(args: argparse.Namespace, result: Any) -> str:
    return (f"deployment {result['deployment_id']} of {result['model_id']}: "
            f"{result['desired_replicas']} wanted, {result['ready_replicas']} ready "
            f"({result['status']})")


def _sleep_text(args: argparse.Namespace, result: Any) -> str:
    which = args.replica or ("each ready replica above its minimum" if args.command == "sleep"
                             else "each sleeping replica")
    return (f"deployment {result['deployment_id']}: {args.command} asked of {which} "
            f"(it was {result['status']}; modelkeeper ls shows the replicas)")


def _retry_text(args: argparse.Namespace, result: Any) -> str:
    return f"deployment {result['deployment_id']}: retry requested (it was {result['status']})"


def _started_text(args: argparse.Namespace, result: Any) -> str:
    """A saga the API started: what it does, and how to watch and cancel it."""
    operation = result["operation_id"]
    return (f"{operation} started: {result['summary']}\n"
            f"watch: modelkeeper operations show {operation}; "
            f"cancel: modelkeeper operations cancel {operation}")


def _cordon_text(args: argparse.Namespace, result: Any) -> str:
    if not result["cordoned"]:
        return f"node {result['name']} ({result['node_id']}): uncordoned"
    reason = f": {result['cordon_reason']}" if result["cordon_reason"] else ""
    return f"node {result['name']} ({result['node_id']}): cordoned{reason}"


def _operations_text(args: argparse.Namespace, result: Any) -> str:
    match args.action:
        case "ls":
            # One line each: a summary or error of hundreds of characters is cut (ops
            # show ID, and --json, give it whole).
            width = cell_width()
            return table([[o["operation_id"], o["state"], o["updated_at"] or "",
                           clip(o["summary"], width), clip(o["error"] or "", width)]
                          for o in result],
                         ["id", "state", "updated", "summary", "error"])
        case "show":
            return _operation_text(result)
        case _:
            operation = result["operation_id"]
            return (f"{operation}: cancel requested; the saga undoes what it started and ends "
                    f"cancelled (watch: modelkeeper operations show {operation})")


def _operation_text(operation: dict[str, Any]) -> str:
    """One operation: its outcome, what it is, and each step in order."""
    on = operation["deployment_id"] or operation["node_id"]
    lines = [f"{operation['operation_id']}: {operation['state']} ({operation['kind']} of {on}, "
             f"requested by {operation['requested_by'] or '-'}, updated "
             f"{operation['updated_at']})", operation["summary"]]
    if operation["error"]:
        lines.append(f"error: {operation['error']}")
    if operation["steps"]:
        lines.append(table([[s["name"], s["state"], s["detail"]] for s in operation["steps"]],
                           ["step", "state", "detail"]))
    return "\n".join(line for line in lines if line)


def _when(value: str | None) -> str:
    """An ISO time as ``2026-03-02 06:55Z`` (UTC), or ``-``."""
    return "-" if not value else value.replace("T", " ")[:16] + "Z"


def _window_line(view: dict[str, Any]) -> list[str]:
    w = view["window"]
    return [w["name"], ",".join(w["days"]), f"{w['start']}-{w['end']}", w["timezone"],
            str(w["min_replicas"]), str(w["max_replicas"]), f"{w['prewarm_s']}s",
            "open" if view["open_now"] else "closed", _when(view.get("next_open")),
            _when(view.get("next_close"))]


_WINDOW_HEADERS = ["name", "days", "hours", "timezone", "min", "max", "prewarm", "now",
                   "next open (utc)", "next close (utc)"]


def _resources(resources: dict[str, Any], *, limit: bool = False) -> str:
    """``16.0 GiB, 2 GPU, 4 cores``: the parts that are set. A part of 0 is left out,
    except in a limit, where 0 allows nothing (an unset limit part is null)."""
    parts = []
    for field, show in (("memory_bytes", _mem), ("gpus", lambda v: f"{v} GPU"),
                        ("cpu_cores", lambda v: f"{v:g} cores")):
        value = resources.get(field)
        if value is not None and (limit or value):
            parts.append(show(value))
    return ", ".join(parts) or ("unlimited" if limit else "-")


def _quota_line(view: dict[str, Any]) -> list[str]:
    return [view["scope"], _resources(view["guarantee"]),
            _resources(view["limit"], limit=True), _resources(view["held"]),
            _resources(view["borrowed"]), ", ".join(view["at_limit"]) or "-"]


def _quota_text(args: argparse.Namespace, result: Any) -> str:
    if args.action == "rm":
        return f"quota of {result['scope']} removed"
    rows = result if isinstance(result, list) else [result]
    return table([_quota_line(v) for v in rows],
                 ["scope", "guarantee", "limit", "held", "borrowed", "at limit"])


def _hold_text(args: argparse.Namespace, result: Any) -> str:
    held = _held_for(result)
    return (f"node {result['name']} ({result['node_id']}): "
            + (f"held for {held}" if held != "-" else "not held"))


def _engines(node: dict[str, Any]) -> str:
    """The engines a node runs, "llamacpp 2026.10.11549,sim 0.2.0"; "?" when its agent
    did not say (placement then takes it as able to run any)."""
    engines = node.get("engines")
    if engines is None:
        return "?"
    return ",".join(f"{name} {version}" for name, version in sorted(engines.items())) or "-"


def _held_for(node: dict[str, Any]) -> str:
    """What the node is held for, as the nodes table shows it; "-" when nothing."""
    parts = [f"{kind} {node[key]}" for kind, key in (("class", "hold_class"),
                                                    ("owner", "hold_owner"))
             if node.get(key)]
    return ", ".join(parts) or "-"


def _power_cap_text(args: argparse.Namespace, result: Any) -> str:
    if not result:
        return "no power cap in force"
    return table([["facility" if pdu == FACILITY_CAP_KEY else pdu, f"{watts:,} W"]
                  for pdu, watts in result.items()], ["pdu", "cap"])


def _owner_text(args: argparse.Namespace, result: Any) -> str:
    return f"deployment {result['deployment_id']} of {result['model_id']}: owner {result['owner']}"


def _schedule_text(args: argparse.Namespace, result: Any) -> str:
    match args.action:
        case "ls":
            return table([_window_line(v) for v in result], _WINDOW_HEADERS)
        case "rm":
            return f"window {result['name']} removed from {result['deployment_id']}"
        case _:
            now = " (inside it now: opened at once)" if result["open_now"] else ""
            return (f"window {result['window']['name']} added to {result['deployment_id']}"
                    f"{now}\n" + table([_window_line(result)], _WINDOW_HEADERS))


def _idle(seconds: float) -> str:
    """Idle time in whole hours and minutes: ``2h 05m``, ``14m``."""
    minutes = int(seconds // 60)
    return f"{minutes // 60}h {minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


def _status_text(args: argparse.Namespace, result: Any) -> str:
    """GET /fleet for a person: the aggregates first, then the lists."""
    nodes = ", ".join(f"{n} {state}" for state, n in result["nodes"].items()) or "none"
    memory = result["memory"]
    unknown = result["nodes_memory_unknown"]
    lines = [f"nodes: {nodes}",
             f"memory: {format_gib(memory['used_bytes'])} used of "
             f"{format_gib(memory['total_bytes'])}, {format_gib(memory['free_bytes'])} free"
             + (f" ({unknown} ready node(s) do not report memory)" if unknown else "")]
    if result["gpus"]:
        lines.append(table([[g["gpu_class"], str(g["total"]), str(g["used"]), str(g["free"]),
                             str(g["unhealthy"])] for g in result["gpus"]],
                           ["gpu class", "total", "used", "free", "unhealthy"]))
    whole = result["free_whole_nodes"]
    lines.append(f"free whole nodes: {len(whole)}" + (f" ({', '.join(whole)})" if whole
                                                      else ""))
    replicas = ", ".join(f"{n} {state}" for state, n in result["replicas"].items())
    lines.append(f"deployments: {result['deployments']}; replicas: "
                 f"{sum(result['replicas'].values())}" + (f" ({replicas})" if replicas else "")
                 + f"; models: {result['models_deployed']} deployed of "
                 f"{result['models_in_catalog']} in the catalog")
    if result["cant_place"]:
        lines.append("cannot be placed:")
        lines.append(table([[w["deployment_id"], w["model_id"], w["status"], w["reason"]]
                            for w in result["cant_place"]],
                           ["deployment", "model", "status", "reason"]))
    hours = format_duration(result["unasked_after_s"])
    if result["unasked"]:
        lines.append(f"asked for by nobody in {hours} or more:")
        lines.append(table([[u["replica_id"], u["deployment_id"], u["state"],
                             _idle(u["idle_s"]), format_gib(u["memory_bytes"]),
                             ",".join(u["nodes"])] for u in result["unasked"]],
                           ["replica", "deployment", "state", "idle", "memory", "nodes"]))
    if result["usage_unknown"]:
        lines.append("usage unknown (no gateway reports it; unknown is not idle): "
                     + ", ".join(u["replica_id"] for u in result["usage_unknown"]))
    return "\n".join(lines)


def _headroom_text(args: argparse.Namespace, result: Any) -> str:
    room = result["headroom"]
    more = "or more " if room["capped"] else ""
    name = result["model_id"] + (f" ({result['deployment_id']})" if result["deployment_id"]
                                 else " (not deployed)")
    lines = [f"{name}, {format_gib(result['memory_bytes'])} a replica: {room['now']} "
             f"more fit now; {len(room['by_stopping'])} {more}more by stopping others"]
    if room["by_stopping"]:
        lines.append(table([[f"+{i}", ", ".join(
                                 f"{v['replica_id']} ({v['kind']}, {v['runs_as']})"
                                 for v in s["victims"]) or "(room already made)",
                             format_gib(s["frees"]["memory_bytes"]), ",".join(s["place_on"])]
                            for i, s in enumerate(room["by_stopping"], start=1)],
                           ["replica", "stopping", "frees", "on"]))
    if room["reason"]:
        lines.append(f"no more: {room['reason']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# The flags each command adds to the common ones (--api-url, --json)


def _policy_flags(parser: argparse.ArgumentParser) -> None:
    """The scaling policy's flags (POLICY_FLAGS); their values are parsed with the
    request, so a bad one is a sentence naming it, not argparse's."""
    helps = {
        "--min": "the fewest replicas it runs (0: none while unused)",
        "--max": "the most replicas it runs (--min 0 --max 1 or more: loaded on demand)",
        "--idle": "stop a replica above --min unused this long, e.g. 10m ('off': never)",
        "--sleep-after": "sleep a replica above --min unused this long, before --idle stops "
                         "it (vLLM, SGLang, sim; 'off': never)",
        "--load-wait": "how long the gateway holds a request while the model loads or wakes "
                       "(default: the gateway's gateway_load_wait_s)",
        "--standby": "sleeping replicas kept on other nodes, woken if a serving one is lost",
    }
    for flag in POLICY_FLAGS:
        parser.add_argument(flag.flag, dest=flag.dest, type=str if flag.duration else int,
                            metavar="DURATION" if flag.duration else "N",
                            help=helps[flag.flag])


def _deploy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id")
    parser.add_argument("--replicas", type=int,
                        help=f"a fixed count, min = max = N (default {DEFAULT_REPLICAS}); "
                             "or give a policy with --min/--max")
    _policy_flags(parser)
    parser.add_argument("--min-nodes", type=int, default=1)
    parser.add_argument("--node", dest="node_ids", action="append", metavar="NODE",
                        help="only this node, by name or id; repeatable")
    parser.add_argument("--require-label", dest="require_labels", action="append",
                        default=[], metavar="KEY=VALUE", help="node label; repeatable")
    parser.add_argument("--owner", metavar="SCOPE",
                        help="its owner in the tenancy tree: org, org/team or "
                             "org/team/project (a scoped token's scope by default)")
    parser.add_argument("--class", dest="capacity_class", choices=list(CapacityClass),
                        help="what may be stopped to place it (default: follows its "
                             "scaling: on demand is opportunistic, else standard)")
    _room_flags(parser)


def _room_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--if-no-room", choices=[c.value for c in IfNoRoom],
                        help="without room on the ready nodes: queue (accepted, waits: the "
                             "default) or plan (refused, listing the plans that make room)")
    parser.add_argument("--plan", type=int, metavar="N",
                        help="apply plan N of those listed first (its sleeps and "
                             "scale-downs, undone if the room is not made)")


def _no_flags(parser: argparse.ArgumentParser) -> None:
    pass


def _notify_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["test"],
                        help="test: send a test notification to each configured target now "
                        "and report what each answered (exit 1 if any failed)")


def _notify_request(args: argparse.Namespace) -> Request:
    return Request("POST", "/notify/test", then=_notify_checked)


def _notify_line(result: dict[str, Any]) -> str:
    said = "delivered" if result["delivered"] else "FAILED"
    return f"{result['target']} ({result['format']}): {said}: {result['detail']}"


def _notify_checked(answer: Any) -> Any:
    """Each target's answer; a target that failed makes the command fail (exit 1),
    naming every answer: a test that exits 0 on a dead webhook would fool a script."""
    failed = [r for r in answer["results"] if not r["delivered"]]
    if failed:
        raise ApiError(f"{len(failed)} of {len(answer['results'])} notification target(s) "
                       "failed: " + "; ".join(_notify_line(r) for r in answer["results"]))
    return answer


def _notify_text(args: argparse.Namespace, result: Any) -> str:
    return "\n".join(_notify_line(r) for r in result["results"])


def _headroom_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODEL_OR_DEPLOYMENT",
                        help="a deployment (by id or model id), or a catalog model not "
                             "deployed yet")


def _rm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target")


def _explain_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", nargs="?", metavar="MODEL",
                        help="a catalog model (when it is deployed, as its deployment asks)")
    parser.add_argument("--deployment", metavar="DEPLOYMENT",
                        help="a deployment's next replica, by id or model id: its labels, "
                             "nodes, minimum of nodes and class apply")


def _deployment_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="DEPLOYMENT", help="deployment id or model id")


def _scale_flags(parser: argparse.ArgumentParser) -> None:
    _deployment_flags(parser)
    parser.add_argument("count", type=int, metavar="N", nargs="?",
                        help="a fixed count (as --replicas)")
    parser.add_argument("--replicas", type=int, metavar="N",
                        help="a fixed count, min = max = N (the policy goes)")
    _policy_flags(parser)
    _room_flags(parser)


def _sleep_flags(parser: argparse.ArgumentParser) -> None:
    _deployment_flags(parser)
    parser.add_argument("--replica", metavar="REPLICA",
                        help="only this replica (default: sleep: each ready one above the "
                             "minimum; wake: each sleeping one)")


def _switch_flags(parser: argparse.ArgumentParser) -> None:
    _deployment_flags(parser)
    parser.add_argument("model_id", metavar="MODEL", help="the catalog model to serve")


def _reconfigure_flags(parser: argparse.ArgumentParser) -> None:
    _deployment_flags(parser)
    parser.add_argument("engine_args", nargs="+", metavar="KEY=VALUE",
                        help="allow-listed engine argument")


def _nodes_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["ls", "rm"], default="ls")
    parser.add_argument("node", nargs="?", metavar="NODE", help="rm: node id or name")
    parser.add_argument("--force", action="store_true",
                        help="rm: remove it even while replicas hold claims on it (their "
                             "deployments place them again)")


def _node_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", metavar="NODE", help="node id or name")


def _cordon_flags(parser: argparse.ArgumentParser) -> None:
    _node_flags(parser)
    parser.add_argument("--reason", help="shown with the node (e.g. 'disk swap')")


def _hold_flags(parser: argparse.ArgumentParser) -> None:
    _node_flags(parser)
    parser.add_argument("--class", dest="capacity_class", choices=list(CapacityClass),
                        help="only this class's replicas may be placed on it")
    parser.add_argument("--owner", metavar="SCOPE",
                        help="only this scope's (and those beneath it) may be placed on it")


def _power_cap_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["ls", "set", "rm"], default="ls")
    parser.add_argument("pdu", nargs="?", metavar="PDU",
                        help=f"a node's topology.pdu label, or {FACILITY_CAP_KEY} for the "
                             "whole facility")
    parser.add_argument("watts", nargs="?", type=int, metavar="WATTS",
                        help="set: the most watts the PDU's nodes may draw together, "
                             "counted from their shards' declared watts")


def _drain_flags(parser: argparse.ArgumentParser) -> None:
    _node_flags(parser)
    parser.add_argument("--grace", type=float, metavar="SECONDS",
                        help="time to move the replicas elsewhere (default 300)")
    parser.add_argument("--uncordon-on-cancel", action="store_true",
                        help="cancelling the drain uncordons the node too")


def _events_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--follow", "-f", action="store_true",
                        help="after the past entries, print new ones as they come, until "
                             "Ctrl-C")
    parser.add_argument("--deployment", help="only this deployment's: its id or model id")
    parser.add_argument("--node", help="only this node's: its id or name")
    parser.add_argument("--kind", help="only this kind, or kinds starting with it when it "
                                       "ends in '.' (replica.)")
    parser.add_argument("--limit", type=int, metavar="N",
                        help=f"the newest N past entries (default 100; {EVENTS_FOLLOW_HISTORY} "
                             "with --follow)")


def _wait_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", action="store_true",
                        help="wait until the work ends, printing its events; exit 1 when it "
                             "fails, rolls back, is parked, cannot be placed or times out")
    parser.add_argument("--timeout", type=_wait_timeout, default=DEFAULT_WAIT_TIMEOUT_S,
                        metavar="DURATION",
                        help="with --wait: give up after this long (90s, 10m; default "
                             f"{format_duration(DEFAULT_WAIT_TIMEOUT_S)})")


def _wait_timeout(raw: str) -> float:
    try:
        value = parse_duration(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--timeout {raw}: must be above 0")
    return value


def _operations_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["ls", "show", "cancel"], default="ls")
    parser.add_argument("operation_id", nargs="?", metavar="ID")
    parser.add_argument("--deployment",
                        help="ls: only this deployment's (by id or model id)")
    parser.add_argument("--node", help="ls: only this node's (by id or name)")
    parser.add_argument("--state", help="ls: only in this state (running, failed, ...)")
    parser.add_argument("--limit", type=int, help="ls: at most this many (default 50)")


def _schedule_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["add", "ls", "rm"])
    _deployment_flags(parser)
    parser.add_argument("window", nargs="?", metavar="NAME", help="rm: the window's name")
    parser.add_argument("--name", help="add: the window's name (a-z, 0-9, '-', '_')")
    parser.add_argument("--days", help=f"add: {_DAYS_ACCEPTED}")
    parser.add_argument("--start", help="add: HH:MM, wall clock in --tz")
    parser.add_argument("--end", help="add: HH:MM; at or before --start: the next day's")
    parser.add_argument("--tz", help="add: IANA time zone, e.g. Europe/Berlin or UTC")
    parser.add_argument("--min", type=int, metavar="N", help="add: replicas at least")
    parser.add_argument("--max", type=int, metavar="N", help="add: replicas at most")
    parser.add_argument("--prewarm", metavar="DURATION",
                        help=f"add: open this early so replicas are ready at --start: "
                             f"{_PREWARM_ACCEPTED}")


def _quota_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["ls", "set", "rm"], default="ls")
    parser.add_argument("scope", nargs="?", metavar="SCOPE",
                        help="org, org/team or org/team/project")
    helps = {"memory": "e.g. 16GiB", "gpus": "a whole number", "cores": "e.g. 4 or 0.5"}
    for flag in QUOTA_FLAGS:
        kind = flag.flag.rsplit("-", 1)[1]
        parser.add_argument(flag.flag, dest=flag.dest, metavar="N",
                            help=f"{flag.side} of {kind}, {helps[kind]} (set replaces the "
                                 "whole quota: a part not given is not "
                                 + ("guaranteed)" if flag.side == "guarantee"
                                    else "limited)"))


def _owner_flags(parser: argparse.ArgumentParser) -> None:
    _deployment_flags(parser)
    parser.add_argument("scope", metavar="SCOPE",
                        help="its new owner: org, org/team or org/team/project")


def _size_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_id", metavar="MODEL", help="the catalog model")
    parser.add_argument("--rps", type=float, required=True, metavar="R",
                        help="the target rate, requests per second")
    parser.add_argument("--profile", help="size by this profile's measurement (default: "
                                          "the most cautious of the model's)")


def _models_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["ls", "show", "add", "edit", "rm"],
                        default="ls")
    parser.add_argument("model_id", nargs="?")
    parser.add_argument("--engine", choices=[e.value for e in EngineKind])
    parser.add_argument("--source", help=SOURCE_HELP)
    parser.add_argument("--memory", help="declared working set, e.g. 12GiB")
    parser.add_argument("--weights", help="what a sleeping replica keeps of --memory (its "
                                          "weights), e.g. 8GiB; unset: all of it")
    parser.add_argument("--default-max-tokens", type=int, metavar="N",
                        help="max_tokens the gateway sends when a request names none")
    parser.add_argument("--max-tokens-limit", type=int, metavar="N",
                        help="most tokens one request may ask for; more is lowered to N")
    parser.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                        metavar="KEY=VALUE", help="allow-listed engine argument; repeatable")
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="GPUs per shard (vLLM, SGLang); unset: none")
    parser.add_argument("--min-nodes", type=int, metavar="N",
                        help="nodes one replica spans, one shard each (default 1)")
    parser.add_argument("--engine-version", metavar="SPEC",
                        help="versions of the engine that will do, e.g. '>=0.6.0' or "
                             "'==0.6.3' (PEP 440); nodes whose agent reports another are "
                             "passed over, and say why")
    parser.add_argument("--profiles", metavar="FILE",
                        help="a JSON list of hardware profiles ({name, engine, memory_bytes, "
                             "gpus, cpu_cores, engine_args, engine_version, priority}), "
                             "tried in priority "
                             "order where a replica is placed (docs/capacity.md)")
    parser.add_argument("--unset-engine-arg", dest="unset_engine_args", action="append",
                        default=[], metavar="KEY",
                        help="edit: remove this engine argument; repeatable")
    parser.add_argument("--sha256", metavar="HEX",
                        help="edit: the SHA-256 of the new source's file ('none': check "
                             "nothing); a model with one needs it with a new --source")
    parser.add_argument("--apply", action="store_true",
                        help="edit: roll the change out now, restarting each deployment "
                             "that serves the model (a saga each, with rollback)")


# ----------------------------------------------------------------------------------------
# `logs`: an engine's log, read on its node (modelkeeper.domain.log_reads)


def _logs_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("replica_id", metavar="REPLICA",
                        help="the replica (`modelkeeper ls --json` lists them)")
    parser.add_argument("--tail", type=int, default=DEFAULT_TAIL_LINES,
                        help=f"the last N lines (default {DEFAULT_TAIL_LINES}, at most "
                             f"{MAX_TAIL_LINES})")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="then print new lines as the engine writes them, until Ctrl-C")
    parser.add_argument("--rank", type=int, default=0,
                        help="the shard of a multi-node replica (default 0)")
    parser.add_argument("--node", help="the node (name or id) whose log to read, for a "
                                       "replica the API no longer knows")


def _logs_params(args: argparse.Namespace, *, after: int | None = None) -> dict[str, str]:
    params = {"tail": str(args.tail), "rank": str(args.rank)}
    if args.node:
        params["node"] = args.node
    if after is not None:
        params["after"] = str(after)
    return params


def _logs_request(args: argparse.Namespace) -> Request:
    if not 0 <= args.tail <= MAX_TAIL_LINES:
        raise UsageError(f"logs --tail {args.tail}: give 0 to {MAX_TAIL_LINES} lines")
    if args.rank < 0:
        raise UsageError(f"logs --rank {args.rank}: ranks count from 0")
    return Request("GET", f"/replicas/{quote(args.replica_id, safe='')}/logs",
                   params=_logs_params(args))


def _logs_next(args: argparse.Namespace, chunk: Any) -> Request:
    """The follow's next read: what was written since the last answer ended."""
    return Request("GET", f"/replicas/{quote(args.replica_id, safe='')}/logs",
                   params=_logs_params(args, after=int(chunk["end_offset"])))


def _logs_text(args: argparse.Namespace, chunk: Any) -> str:
    lines = [str(line) for line in chunk["lines"]]
    if chunk.get("restarted"):
        lines.insert(0, f"-- a new log began in {chunk['log_path']} on node "
                        f"{chunk['node_id']} (the engine was launched again) --")
    return "\n".join(lines)


def _follow(command: Command, args: argparse.Namespace, answer: Any, http: httpx.Client,
            out: Out) -> int:
    """Ask for what is new every FOLLOW_INTERVAL_S and print it, until Ctrl-C, which ends
    the command quietly (exit 0)."""
    assert command.follow is not None
    try:
        while True:
            time.sleep(FOLLOW_INTERVAL_S)  # the pace of the polls, not a synchronisation
            answer = execute(command.follow(args, answer), http)
            text = render(args, answer)
            if text:
                out(text)
    except KeyboardInterrupt:
        return 0


# ----------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Command:
    """One operator command: its flags, the request it sends, and its text rendering."""

    name: str
    help: str
    flags: Callable[[argparse.ArgumentParser], None]
    request: Callable[[argparse.Namespace], Request]
    text: Callable[[argparse.Namespace, Any], str]
    #: Other names it answers to: a rename keeps the old name working for scripts.
    aliases: tuple[str, ...] = ()
    #: With ``--follow``: the next request, from the last answer (``logs``); None: the
    #: command does not follow.
    follow: Callable[[argparse.Namespace, Any], Request] | None = None
    #: Whether its work goes on after the answer: it takes ``--wait`` and ``--timeout``.
    waits: bool = False
    #: ``--json``'s rendering, where it is not the answer as one JSON document.
    json: Callable[[argparse.Namespace, Any], str] | None = None


COMMANDS: tuple[Command, ...] = (
    Command("deploy", "keep a model served", _deploy_flags, _deploy_request, _deploy_text,
            waits=True),
    Command("ls", "list deployments", _no_flags, _ls_request, _ls_text),
    Command("status", "the fleet at a glance: capacity used and free, free whole nodes, "
            "what cannot be placed, what nobody asked for lately", _no_flags,
            _status_request, _status_text),
    Command("headroom", "how many more replicas of a model fit, and by stopping which",
            _headroom_flags, _headroom_request, _headroom_text),
    Command("rm", "delete a deployment (by id or model id)", _rm_flags, _rm_request,
            _rm_text,
            waits=True),
    Command("nodes", "list nodes, or remove one (nodes rm NODE [--force])", _nodes_flags,
            _nodes_request, _nodes_text),
    Command("explain", "dry-run placement of one replica of a model, or of a deployment "
            "(--deployment: its labels and nodes apply)", _explain_flags,
            _explain_request, _explain_text),
    Command("models", "list the model catalog, show one (with its measured capacity), "
            "add, edit (memory, engine arguments, source; --apply restarts its deployments) "
            "or remove a model", _models_flags, _models_request, _models_text),
    Command("size", "how many replicas a target rate needs, by the model's measured "
            "capacity, against the room there is", _size_flags, _size_request, _size_text),
    Command("scale", "set a deployment's replica count, or its scaling policy", _scale_flags,
            _scale_request, _scale_text,
            waits=True),
    Command("sleep", "put a deployment's replicas to sleep (vLLM, SGLang, sim)", _sleep_flags,
            _sleep_request, _sleep_text,
            waits=True),
    Command("wake", "wake a deployment's sleeping replicas", _sleep_flags, _sleep_request,
            _sleep_text,
            waits=True),
    Command("retry", "un-park a parked deployment", _deployment_flags, _retry_request,
            _retry_text,
            waits=True),
    Command("restart", "replace each replica of a deployment in turn", _deployment_flags,
            _restart_request, _started_text,
            waits=True),
    Command("switch", "serve another model under a deployment's name, with rollback",
            _switch_flags, _switch_request, _started_text,
            waits=True),
    Command("reconfigure", "change a deployment's engine arguments, with rollback",
            _reconfigure_flags, _reconfigure_request, _started_text,
            waits=True),
    Command("cordon", "place nothing new on a node", _cordon_flags, _cordon_request,
            _cordon_text),
    Command("uncordon", "let placement use a node again", _node_flags, _uncordon_request,
            _cordon_text),
    Command("drain", "cordon a node and move its replicas elsewhere", _drain_flags,
            _drain_request, _started_text,
            waits=True),
    Command("hold", "keep a node for a capacity class or an owner scope", _hold_flags,
            _hold_request, _hold_text),
    Command("unhold", "release a node's hold", _node_flags, _unhold_request, _hold_text),
    Command("operations", "list operations (restarts, drains, switches), or show or cancel "
            "one (alias: ops)", _operations_flags, _operations_request, _operations_text,
            aliases=("ops",)),
    Command("schedule", "add, list or remove a deployment's windows of scaling by the "
            "clock (own min and max on set days and hours, in a time zone)", _schedule_flags,
            _schedule_request, _schedule_text),
    Command("quota", "list the quotas of the tenancy tree's scopes, or set or remove one "
            "(guarantee and limit of memory, GPUs and cores)", _quota_flags, _quota_request,
            _quota_text),
    Command("owner", "move a deployment to another owner (org, org/team or "
            "org/team/project)", _owner_flags, _owner_request, _owner_text),
    Command("power-cap", "list the power caps, or set or remove a PDU's (or the "
            "facility's)", _power_cap_flags, _power_cap_request, _power_cap_text),
    Command("notify", "notifications: `notify test` sends a test to each configured "
            "webhook and Slack target and reports each answer", _notify_flags,
            _notify_request, _notify_text),
    Command("logs", "print a replica's engine log, read on its node (admin token: a log "
            "may hold prompts); --follow prints new lines until Ctrl-C", _logs_flags,
            _logs_request, _logs_text, follow=_logs_next),
    Command("events", "the audit log: the newest entries, and with --follow new ones as "
            "they come (by deployment, node, kind)", _events_flags, _events_request,
            _events_text, json=_events_json),
)

OPERATOR_COMMANDS: Mapping[str, Command] = {c.name: c for c in COMMANDS}


def add_operator_commands(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the operator subcommands on the main parser's subparsers."""
    for command in COMMANDS:
        parser: argparse.ArgumentParser = sub.add_parser(command.name, help=command.help,
                                                         aliases=command.aliases)
        # argparse records the name as typed; an alias reads as its command.
        parser.set_defaults(command=command.name)
        parser.add_argument("--api-url", help="overrides MODELKEEPER_API_URL")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        common(parser)
        command.flags(parser)
        if command.waits:
            _wait_flags(parser)


def render(args: argparse.Namespace, result: Any) -> str:
    """``result`` as ``--json`` asked, or as the command's text."""
    command = OPERATOR_COMMANDS[args.command]
    if args.json:
        return (json.dumps(result, indent=2, default=str) if command.json is None
                else command.json(args, result))
    return command.text(args, result)


class Afterwards(Protocol):
    """What runs once a command's answer is printed: cli.follow's ``--wait`` and
    ``events --follow`` (``main`` passes it; this module does not import it)."""

    def wanted(self, args: argparse.Namespace) -> bool:
        """Whether ``args`` ask for more than the answer."""

    def mark(self, args: argparse.Namespace, http: httpx.Client) -> int | None:
        """Read before the command is sent: the newest event id, where it matters."""

    def run(self, args: argparse.Namespace, result: Any, *, base_url: str,
            headers: dict[str, str], mark: int | None, out: Out) -> int:
        """The rest of the command; its exit code."""


def run_operator_command(args: argparse.Namespace, api_url: str, out: Out, *,
                         token: str | None = None,
                         transport: httpx.BaseTransport | None = None,
                         afterwards: Afterwards | None = None) -> int:
    """Run one operator command against the API at ``api_url`` (``--api-url`` wins),
    presenting ``token`` as the operator (none: the API answers 401 saying what it needs),
    then, when the arguments ask for it, ``afterwards`` (``--wait``, ``--follow``).

    Raises ``UsageError`` for a user mistake, ``ApiError`` when the API fails; the request
    is built before any connection, so a malformed argument never reaches the API.
    """
    request = OPERATOR_COMMANDS[args.command].request(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base_url = args.api_url or api_url
    command = OPERATOR_COMMANDS[args.command]
    following = command.follow is not None and bool(getattr(args, "follow", False))
    more = afterwards is not None and afterwards.wanted(args)
    with httpx.Client(base_url=base_url, timeout=API_TIMEOUT_S,
                      headers=headers, transport=transport) as http:
        mark = afterwards.mark(args, http) if more and afterwards is not None else None
        try:
            result = execute(request, http)
        except KeyboardInterrupt:
            if following:  # Ctrl-C ends a follow quietly, even before its first answer
                return 0
            raise
        text = render(args, result)
        if text or command.follow is None:  # a follow prints nothing until there is some
            out(text)
        if following:
            return _follow(command, args, result, http, out)
    if more and afterwards is not None:
        return afterwards.run(args, result, base_url=base_url, headers=headers, mark=mark,
                              out=out)
    return 0


def operator_token(settings: Settings) -> str | None:
    """The token the CLI presents: ``token`` (MODELKEEPER_TOKEN), else the file
    ``token_file`` (MODELKEEPER_TOKEN_FILE), else ``<data_dir>/operator-token`` when it
    exists (where `up` writes the local admin token); None when there is none.

    A ``token_file`` named but missing, unreadable or empty is a ``UsageError``.
    """
    if settings.token:
        return settings.token.strip()
    path = settings.token_file or settings.operator_token_file
    named = "token_file (MODELKEEPER_TOKEN_FILE)"
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        if settings.token_file is None:
            return None
        raise UsageError(f"{named} = {str(path)!r}: no such file; point it at a file "
                         "holding an operator token (modelkeeper tokens create)") from None
    except OSError as exc:
        raise UsageError(f"{named} = {str(path)!r} cannot be read: {exc.strerror}") from None
    if not token:
        raise UsageError(f"{named} = {str(path)!r} is empty; it must hold an operator "
                         "token (modelkeeper tokens create)")
    return token


# ----------------------------------------------------------------------------------------
# `tokens`: operator tokens, straight in the database (as `keys` does for client keys)


def _token_row(record: OperatorTokenRecord) -> list[str]:
    revoked = record.revoked_at.isoformat(timespec="seconds") if record.revoked_at else "-"
    return [record.token_id, record.prefix + "…", record.name, record.role.value,
            record.scope or "-", record.created_at.isoformat(timespec="seconds"), revoked]


async def _tokens(database_url: str, args: argparse.Namespace, out: Out) -> int:
    async with await TokensStore.connect(database_url) as tokens:
        match args.tokens_action:
            case "create":
                record, token = await tokens.create_token(
                    args.token_name, OperatorRole(args.role), scope=args.scope)
                out(token)
                bound = f", bound to {record.scope}" if record.scope else ""
                out(f"# token {record.token_id} ({record.name}, {record.role.value}{bound}); it is "
                    "shown this once, only its hash is stored. The CLI sends it from "
                    "MODELKEEPER_TOKEN or the file MODELKEEPER_TOKEN_FILE; others send "
                    "`Authorization: Bearer <token>`.")
            case "ls":
                out(table([_token_row(r) for r in await tokens.list_tokens()],
                          ["id", "prefix", "name", "role", "scope", "created", "revoked"]))
            case _:
                revoked = await tokens.revoke_tokens(args.token_id)
                if not revoked:
                    raise UsageError(f"tokens revoke {args.token_id!r}: no active token has "
                                     "that id or prefix (modelkeeper tokens ls lists them)")
                for record in revoked:
                    out(f"revoked {record.token_id} ({record.name}, {record.role.value}, "
                        f"{record.prefix}…)")
    return 0


def run_tokens_command(database_url: str, args: argparse.Namespace, out: Out) -> int:
    """Run one `tokens` action (``args.tokens_action``) against the database; exit code.

    A name the audit log could not show as one word is a ``UsageError``, before any
    connection."""
    if args.tokens_action == "create":
        problem = name_problem(args.token_name)
        if problem is not None:
            raise UsageError(f"tokens create: {problem}")
        if args.scope is not None:
            parse_scope(args.scope, flag="--scope")
    return asyncio.run(_tokens(database_url, args, out))
