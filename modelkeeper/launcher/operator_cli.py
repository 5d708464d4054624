"""`modelkeeper deploy / ls / rm / nodes / explain / models`: thin wrappers over the API.

Tables for a person, ``--json`` for scripts. API errors are one line naming what the API
said, never a traceback.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from ..domain.units import format_gib, parse_bytes

Out = Callable[[str], None]


class ApiError(Exception):
    """The API refused a request; the message is what it said."""


def add_operator_commands(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the operator subcommands on the main parser's subparsers."""

    def cmd(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        parser.add_argument("--api-url", help="overrides MODELKEEPER_API_URL")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        common(parser)
        return parser

    deploy = cmd("deploy", "keep a model served")
    deploy.add_argument("model_id")
    deploy.add_argument("--replicas", type=int, default=1)
    deploy.add_argument("--min-nodes", type=int, default=1)
    deploy.add_argument("--node", dest="node_ids", action="append", metavar="NODE_ID",
                        help="only these nodes; repeatable")
    deploy.add_argument("--require-label", dest="require_labels", action="append",
                        default=[], metavar="KEY=VALUE", help="node label; repeatable")
    cmd("ls", "list deployments")
    rm = cmd("rm", "delete a deployment (by id or model id)")
    rm.add_argument("target")
    cmd("nodes", "list nodes")
    explain = cmd("explain", "dry-run placement of one replica of a model")
    explain.add_argument("model_id")
    models = cmd("models", "list the model catalog, or add/remove a model")
    models.add_argument("action", nargs="?", choices=["ls", "add", "rm"], default="ls")
    models.add_argument("model_id", nargs="?")
    models.add_argument("--engine", choices=["llamacpp", "vllm", "sglang", "sim"])
    models.add_argument("--source")
    models.add_argument("--memory", help="declared working set, e.g. 12GiB")
    models.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                        metavar="KEY=VALUE", help="allow-listed engine argument; repeatable")


OPERATOR_COMMANDS = frozenset({"deploy", "ls", "rm", "nodes", "explain", "models"})


def _call(http: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    try:
        resp = http.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise ApiError(f"cannot reach the API at {http.base_url}: {exc}") from None
    if resp.status_code >= 400:
        raise ApiError(f"{resp.status_code} {_detail(resp)}")
    return resp.json() if resp.content else None


def _detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        return resp.text
    if isinstance(detail, list):  # FastAPI validation errors
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg')}"
                         + (f" (got {d['input']!r})" if "input" in d else "") for d in detail)
    return str(detail)


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ApiError(f"{flag} {item!r}: expected KEY=VALUE")
        parsed[key] = value
    return parsed


def table(rows: list[list[str]], headers: list[str]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


def _mem(value: int | None) -> str:
    return "-" if value is None else format_gib(value)


def run_operator_command(args: argparse.Namespace, api_url: str, out: Out) -> int:
    """Run one operator command against the API at ``api_url``."""
    with httpx.Client(base_url=args.api_url or api_url, timeout=30) as http:
        result = _dispatch(args, http)
    if args.json:
        out(json.dumps(result, indent=2, default=str))
    else:
        out(_render(args, result))
    return 0


def _dispatch(args: argparse.Namespace, http: httpx.Client) -> Any:
    if args.command == "deploy":
        body = {"model_id": args.model_id, "replicas": args.replicas,
                "min_nodes": args.min_nodes, "node_ids": args.node_ids,
                "labels": _pairs(args.require_labels, "--require-label")}
        return _call(http, "POST", "/deployments", json=body)
    if args.command == "ls":
        return _call(http, "GET", "/deployments")
    if args.command == "rm":
        target = args.target
        deployments = _call(http, "GET", "/deployments")
        match = next((d for d in deployments if target in (d["deployment_id"], d["model_id"])),
                     None)
        if match is None:
            raise ApiError(f"no deployment with id or model {target!r}")
        return _call(http, "DELETE", f"/deployments/{match['deployment_id']}")
    if args.command == "nodes":
        return _call(http, "GET", "/nodes")
    if args.command == "explain":
        return _call(http, "GET", "/placement/explain", params={"model_id": args.model_id})
    if args.command == "models":
        if args.action == "ls":
            return _call(http, "GET", "/models")
        if not args.model_id:
            raise ApiError(f"models {args.action}: give a model id")
        if args.action == "rm":
            _call(http, "DELETE", f"/models/{args.model_id}")
            return {"model_id": args.model_id, "deleted": True}
        if not args.engine or not args.source:
            raise ApiError("models add: --engine and --source are required")
        model: dict[str, Any] = {"model_id": args.model_id, "engine": args.engine,
                                 "source": args.source,
                                 "engine_args": _engine_args(args.engine_args)}
        if args.memory:
            try:
                model["memory_bytes"] = parse_bytes(args.memory)
            except ValueError as exc:
                raise ApiError(f"--memory: {exc}") from None
        return _call(http, "POST", "/models", json=model)
    raise ApiError(f"unknown command {args.command}")


def _engine_args(items: Sequence[str]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for key, value in _pairs(items, "--engine-arg").items():
        try:
            parsed[key] = json.loads(value)  # numbers and booleans keep their type
        except ValueError:
            parsed[key] = value
    return parsed


def _reason(deployment: dict[str, Any]) -> str:
    """Why a deployment is not serving; a serving one shows its last failure only as
    history, marked so, rather than as a reason."""
    if deployment["status"] == "cant_place":
        return str(deployment["placement_error"] or "")
    if deployment["status"] == "serving":
        last = deployment["last_failure"]
        return f"(last failure: {last})" if last else ""
    return str(deployment["last_failure"] or "")


def _render(args: argparse.Namespace, result: Any) -> str:
    if args.command in ("ls",):
        return table([[d["deployment_id"], d["model_id"], d["status"],
                       f"{d['ready_replicas']}/{d['desired_replicas']}",
                       str(d["consecutive_failures"]), _reason(d)] for d in result],
                     ["id", "model", "status", "ready", "failures", "reason"])
    if args.command == "deploy":
        return (f"deployment {result['deployment_id']} of {result['model_id']}: "
                f"{result['status']} (workflow {result['workflow_id']})")
    if args.command == "rm":
        return f"deployment {result['deployment_id']}: {result['status']}"
    if args.command == "nodes":
        return table([[n["name"], n["node_id"], n["state"], _mem(n["memory_total_bytes"]),
                       _mem(n["memory_claimed_bytes"]), _mem(n["memory_free_bytes"]),
                       "-" if n["cpu_count"] is None else str(n["cpu_count"]),
                       ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())),
                       n["last_seen"]] for n in result],
                     ["name", "id", "state", "memory", "claimed", "free", "cpus", "labels",
                      "last seen"])
    if args.command == "explain":
        head = (f"{result['model_id']}: fits on {', '.join(result['nodes_chosen'])}"
                if result["fits"] else f"{result['model_id']}: cannot be placed: "
                                       f"{result['summary']}")
        return head + "\n" + table([[n["name"], "yes" if n["fits"] else "no", n["message"]]
                                    for n in result["nodes"]], ["node", "fits", "why"])
    if args.command == "models":
        if isinstance(result, list):
            return table([[m["model_id"], m["engine"], m["source"],
                           _mem(m["memory_bytes"]) + (" (estimated)" if m["memory_estimated"]
                                                      else ""),
                           str(m["min_nodes"])] for m in result],
                         ["model", "engine", "source", "memory", "min nodes"])
        if result.get("deleted"):
            return f"model {result['model_id']} removed"
        return f"model {result['model_id']} added ({_mem(result['memory_bytes'])})"
    return json.dumps(result, default=str)
