"""`modelkeeper bench MODEL`: measure, through the gateway, how many concurrent requests
one replica of a deployed model serves within a latency objective, and store it through
the API (PUT /models/{id}/capacity). docs/capacity.md, "Measured capacity".

Levels of concurrency per replica climb 1, 2, 4, ... up to ``--max-concurrency``
(:func:`~modelkeeper.domain.measured.concurrency_steps`); each keeps that many streamed
chat completions open per ready replica for ``--duration`` seconds (and at least
``--min-requests`` requests), and measures the time to the first token and between
tokens of every request. The climb stops at the first level that misses the objective;
the last that met it is the capacity (:func:`~modelkeeper.domain.measured.sustained`).

**Per replica, by spreading:** the load is ``level x ready replicas`` requests at once,
and the gateway sends each request to the replica with the fewest outstanding
(``gateway/table.py``), so every replica holds ``level`` of them. Benching against one
replica would need a way to pin requests to it that clients must never have; spreading
measures the replicas as clients reach them, gateway included. Throughput is divided by
the ready replicas, and the count is stored with the result.

Prompts are unique per request: a repeated prompt is answered from the engine's prefix
cache, and the measurement would describe the cache rather than the hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from modelkeeper.domain.measured import (
    DEFAULT_ITL_P95_S,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_TTFT_P95_S,
    MAX_CONCURRENCY,
    LevelResult,
    Objective,
    concurrency_steps,
    percentile,
    sustained,
)

from .operator_cli import (
    API_TIMEOUT_S,
    Out,
    Request,
    UsageError,
    execute,
    measured_line,
)

#: Seconds each level keeps its load up: long enough for a level of slow requests to
#: finish several each, short enough that a climb of nine levels takes minutes.
DEFAULT_LEVEL_S = 15.0
#: Requests each level completes at least, however long that takes: a p95 over fewer
#: than 20 is the maximum of a handful, not a percentile.
DEFAULT_MIN_REQUESTS = 20
#: Tokens each request asks for: a short chat answer, long enough for an inter-token
#: figure over a hundred gaps.
DEFAULT_MAX_TOKENS = 128
#: The longest one request may take before it counts as failed: past two minutes no
#: objective anyone sets is met, and a level must not hang on a stuck stream.
REQUEST_TIMEOUT_S = 120.0
#: Where the CLI looks for a client API key when the gateway asks for one: the variable
#: the OpenAI clients read, which a gateway client has set already.
API_KEY_ENV = "OPENAI_API_KEY"


@dataclass
class Timing:
    """One streamed request as the client saw it."""

    ok: bool = False
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    duration_s: float = 0.0
    error: str | None = None


async def one_request(client: httpx.AsyncClient, *, model: str, prompt: str,
                      max_tokens: int) -> Timing:
    """Send one streamed chat completion and time its tokens (a content delta each)."""
    timing = Timing()
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    start = last = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                timing.error = f"{resp.status_code} {resp.text[:200]}"
                return timing
            async for line in resp.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data or data == "[DONE]":
                    continue
                if not _has_content(data):
                    continue
                now = time.monotonic()
                if timing.ttft_s is None:
                    timing.ttft_s = now - start
                else:
                    timing.gaps_s.append(now - last)
                last = now
                timing.tokens += 1
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.duration_s = time.monotonic() - start
    timing.ok = timing.ttft_s is not None
    if not timing.ok:
        timing.error = "the stream ended without a token"
    return timing


def _has_content(data: str) -> bool:
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices:
        return False
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content"))


def summarise(timings: Sequence[Timing], *, concurrency: int, replicas: int,
              wall_s: float) -> LevelResult:
    """A level's figures: p95 of every request's TTFT and of every gap between tokens,
    tokens/s per replica over the level's wall time, the mean request duration."""
    done = [t for t in timings if t.ok]
    ttfts = [t.ttft_s for t in done if t.ttft_s is not None]
    gaps = [g for t in done for g in t.gaps_s]
    return LevelResult(
        concurrency=concurrency, requests=len(timings),
        errors=sum(1 for t in timings if not t.ok),
        ttft_p95_s=percentile(ttfts, 0.95) if ttfts else None,
        itl_p95_s=percentile(gaps, 0.95) if gaps else None,
        tokens_per_s=sum(t.tokens for t in done) / wall_s / replicas if wall_s > 0 else 0.0,
        mean_request_s=statistics.fmean(t.duration_s for t in done) if done else None)


async def run_level(client: httpx.AsyncClient, *, model: str, concurrency: int,
                    replicas: int, duration_s: float, min_requests: int,
                    max_tokens: int) -> LevelResult:
    """Keep ``concurrency x replicas`` requests open until ``duration_s`` has passed and
    ``min_requests`` have been started; then let the last ones finish."""
    timings: list[Timing] = []
    started = 0
    start = time.monotonic()
    tag = uuid.uuid4().hex[:12]

    async def worker(index: int) -> None:
        nonlocal started
        while time.monotonic() - start < duration_s or started < min_requests:
            started += 1
            # Unique per request: no prefix cache answers it (module docstring).
            prompt = (f"[{tag}-{concurrency}-{index}-{started}] Write a short story about "
                      f"request {started} of worker {index}.")
            timings.append(await one_request(client, model=model, prompt=prompt,
                                             max_tokens=max_tokens))

    await asyncio.gather(*(worker(i) for i in range(concurrency * replicas)))
    return summarise(timings, concurrency=concurrency, replicas=replicas,
                     wall_s=time.monotonic() - start)


async def climb(gateway_url: str, *, model: str, replicas: int, objective: Objective,
                max_concurrency: int, duration_s: float, min_requests: int, max_tokens: int,
                api_key: str | None, out: Out | None = None,
                transport: httpx.AsyncBaseTransport | None = None) -> list[LevelResult]:
    """Every level run, rising, up to and including the first that misses ``objective``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    limits = httpx.Limits(max_connections=max_concurrency * replicas,
                          max_keepalive_connections=max_concurrency * replicas)
    levels: list[LevelResult] = []
    async with httpx.AsyncClient(base_url=gateway_url, headers=headers, limits=limits,
                                 timeout=REQUEST_TIMEOUT_S, transport=transport) as client:
        for concurrency in concurrency_steps(max_concurrency):
            level = await run_level(client, model=model, concurrency=concurrency,
                                    replicas=replicas, duration_s=duration_s,
                                    min_requests=min_requests, max_tokens=max_tokens)
            levels.append(level)
            miss = level.miss(objective)
            if out is not None:
                out(_level_line(level, miss))
            if miss is not None:
                break
    return levels


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _level_line(level: LevelResult, miss: str | None) -> str:
    return (f"  {level.concurrency:>4} per replica: {level.requests} requests, TTFT p95 "
            f"{_ms(level.ttft_p95_s)}, inter-token p95 {_ms(level.itl_p95_s)}, "
            f"{level.tokens_per_s:.1f} tokens/s per replica: "
            + ("meets the objective" if miss is None else f"misses it ({miss})"))


# -- the command ----------------------------------------------------------------------------


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODEL", help="deployment id or model id (deployed "
                                                        "and ready)")
    parser.add_argument("--ttft-p95", type=float, default=DEFAULT_TTFT_P95_S, metavar="S",
                        help=f"time to first token, p95, a level must keep (default "
                             f"{DEFAULT_TTFT_P95_S:g} s: how long a person at a chat waits "
                             "for the first word)")
    parser.add_argument("--itl-p95", type=float, default=DEFAULT_ITL_P95_S, metavar="S",
                        help=f"time between tokens, p95 (default {DEFAULT_ITL_P95_S:g} s: "
                             "10 tokens/s, ahead of a fast reader)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                        metavar="N", help=f"the most requests per replica tried (default "
                                          f"{DEFAULT_MAX_CONCURRENCY})")
    parser.add_argument("--duration", type=float, default=DEFAULT_LEVEL_S, metavar="S",
                        help=f"seconds each level lasts (default {DEFAULT_LEVEL_S:g})")
    parser.add_argument("--min-requests", type=int, default=DEFAULT_MIN_REQUESTS, metavar="N",
                        help=f"requests each level completes at least (default "
                             f"{DEFAULT_MIN_REQUESTS})")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"tokens each request asks for (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--profile", default="", help="the hardware profile the replicas "
                                                      "run, stored with the result")
    parser.add_argument("--gateway-url", help="the gateway (default: this machine's, on "
                                              "MODELKEEPER_GATEWAY_PORT)")
    parser.add_argument("--key-file", type=Path, metavar="PATH",
                        help=f"a file holding a client API key, when the gateway asks for "
                             f"one (else ${API_KEY_ENV})")
    parser.add_argument("--dry-run", action="store_true",
                        help="measure and show, but store nothing")


def _objective(args: argparse.Namespace) -> Objective:
    for flag, value, high in (("--ttft-p95", args.ttft_p95, 600), ("--itl-p95",
                                                                   args.itl_p95, 60)):
        if not 0 < value <= high:
            raise UsageError(f"{flag} {value:g}: must be above 0 and at most {high} s")
    return Objective(ttft_p95_s=args.ttft_p95, itl_p95_s=args.itl_p95)


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value, low, high in (
            ("--max-concurrency", args.max_concurrency, 1, MAX_CONCURRENCY),
            ("--min-requests", args.min_requests, 1, 100_000),
            ("--max-tokens", args.max_tokens, 1, 65_536)):
        if not low <= value <= high:
            raise UsageError(f"{flag} {value}: must be at least {low} and at most {high}")
    if not 0 < args.duration <= 3600:
        raise UsageError(f"--duration {args.duration:g}: must be above 0 and at most 3600 s")


def _api_key(args: argparse.Namespace) -> str | None:
    if args.key_file is None:
        return os.environ.get(API_KEY_ENV) or None
    try:
        return args.key_file.read_text().strip() or None
    except OSError as exc:
        raise UsageError(f"--key-file {str(args.key_file)!r} cannot be read: "
                         f"{exc.strerror}") from None


def _deployment(deployments: list[dict[str, Any]], target: str) -> dict[str, Any]:
    match = next((d for d in deployments if target in (d["deployment_id"], d["model_id"])),
                 None)
    if match is None:
        known = ", ".join(sorted(d["model_id"] for d in deployments)) or "none"
        raise UsageError(f"bench {target!r}: no deployment has that id or model id "
                         f"(deployed models: {known}); deploy it first")
    if match["ready_replicas"] < 1:
        raise UsageError(f"bench {target!r}: no replica is ready ({match['status']}); bench "
                         "measures a ready one through the gateway")
    return match


def run_bench(args: argparse.Namespace, *, api_url: str, gateway_url: str, out: Out,
              token: str | None = None,
              transport: httpx.BaseTransport | None = None) -> int:
    """Measure ``args.target`` through the gateway at ``gateway_url`` and store the
    capacity found through the API at ``api_url``; exit code (2: no level met it)."""
    objective = _objective(args)
    _check_counts(args)
    api_key = _api_key(args)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with httpx.Client(base_url=args.api_url or api_url, timeout=API_TIMEOUT_S,
                      headers=headers, transport=transport) as http:
        deployment = _deployment(execute(Request("GET", "/deployments"), http), args.target)
        model = deployment["model_id"]
        runs = deployment.get("runs_model_id") or model
        replicas = deployment["ready_replicas"]
        out(f"bench {model}: {replicas} ready replica(s) through {gateway_url}; levels up to "
            f"{args.max_concurrency} per replica, {args.duration:g} s each, objective TTFT "
            f"p95 {objective.ttft_p95_s:g} s and inter-token p95 {objective.itl_p95_s:g} s")
        levels = asyncio.run(climb(
            gateway_url, model=model, replicas=replicas, objective=objective,
            max_concurrency=args.max_concurrency, duration_s=args.duration,
            min_requests=args.min_requests, max_tokens=args.max_tokens, api_key=api_key,
            out=out))
        best = sustained(levels, objective)
        if best is None:
            raise UsageError(f"bench {model}: even 1 request per replica misses the objective "
                             f"({levels[0].miss(objective)}); nothing stored")
        assert best.ttft_p95_s is not None and best.mean_request_s is not None  # it met it
        report = {"profile": args.profile, "concurrency": best.concurrency,
                  "tokens_per_s": round(best.tokens_per_s, 3),
                  "mean_request_s": round(best.mean_request_s, 4),
                  "ttft_p95_s": round(best.ttft_p95_s, 4),
                  "itl_p95_s": None if best.itl_p95_s is None else round(best.itl_p95_s, 4),
                  "objective": objective.model_dump(), "replicas": replicas,
                  "max_tokens": args.max_tokens}
        if args.dry_run:
            stored: dict[str, Any] = {**report, "model_id": runs, "stored": False}
        else:
            stored = execute(Request("PUT", f"/models/{runs}/capacity", body=report), http)
    if args.json:
        out(json.dumps(stored, indent=2, default=str))
    elif args.dry_run:
        out(f"{runs}: {best.concurrency} concurrent request(s) per replica (not stored)")
    else:
        out(f"{runs}: {measured_line(stored)}")
    return 0
