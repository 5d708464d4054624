"""The soak's figures, from what it recorded: pure functions over the ledger, the ticks, the
faults, the claim checks and the resource samples; then the markdown and the timeline.

Definitions the report states beside its numbers:

* **Unanswered**: a ledger entry without a verdict, or whose verdict is that no answer
  came (:mod:`bench.soak.clients`). Target: 0.
* **Serving again** after a fault: the start of the last unbroken run of ticks, within the
  fault's window (until the next fault), in which every deployment had a ready replica
  and its probe through the gateway was answered; 0 when no tick in the window failed
  (the fault cost no service the probes could see). A window that ends with a failing
  tick is *not recovered* in it. A ready replica is part of it because the gateway holds
  a request while there is none (up to 10 s): the probe is answered in the end, by the
  replacement, though nothing could serve it meanwhile.
* **Status truth**: the share of probes where the API's word (a replica is ready) and the
  gateway's deed (a probe answered within 2 s) agree, the word read as the probe was sent
  or at the first reading after it ended. Probes where the API did not answer,
  or the gateway process itself was down (its restart fault), are counted apart: neither
  is a deployment's status.
* **Claims**: after each fault, once settled, every claim in the store has its engine
  running on the claimed node and every running engine has its claim.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stats import percentile, spread
from modelkeeper.settings import Settings

from .clients import Entry, Outcome
from .faults import DESCRIPTIONS, Fault, FaultKind
from .observe import (
    CLAIM_SCAN_S,
    CLAIM_WITHOUT_ENGINE,
    ENGINE_WITHOUT_CLAIM,
    SETTLE_STABLE_S,
    ClaimCheck,
    Episode,
    Probe,
    Tick,
    Usage,
)

#: The committed run's targets (issue 13).
TARGET_REQUESTS = 50_000
TARGET_FAULTS = 100
TARGET_STATUS_TRUTH = 0.995
#: Bins of the timeline's error panel: one second is too noisy to read kinds apart.
ERROR_BIN_S = 5
#: Error kinds drawn one by one in the timeline; the rest are summed as "other".
PLOTTED_KINDS = 6
#: Unanswered requests listed one by one in the report.
LISTED_UNANSWERED = 20
#: Failed requests kept one by one in the JSON, and the characters of each reason: enough
#: to follow any fault's failures to the request, without a ledger of every answer.
FAILED_KEPT = 5000
REASON_CHARS_KEPT = 160
#: An engine the control plane gave up on while its node was silent is stopped by its
#: agent once unwatched for ``orphan_grace_s`` (120 s): the claim is released before the
#: memory. Past that and a reaper's round or two, it is a leak.
ORPHAN_GRACE_S = float(Settings.model_fields["orphan_grace_s"].default)
ORPHAN_LIMIT_S = ORPHAN_GRACE_S + 30.0
#: A dead replica's claim stays until the replica is declared lost (``replica_lost_after_s``
#: after it went unreachable); past that and the release's own retries, it is a leak.
CLAIM_LIMIT_S = float(Settings.model_fields["replica_lost_after_s"].default) + 45.0
#: How long each kind of disagreement may outlive the fault that caused it.
EPISODE_LIMITS_S = {ENGINE_WITHOUT_CLAIM: ORPHAN_LIMIT_S, CLAIM_WITHOUT_ENGINE: CLAIM_LIMIT_S}


@dataclass(frozen=True)
class Recovery:
    """What a fault cost in service, as the probes saw it."""

    interrupted: bool
    #: Seconds from the fault to serving again; None: not serving again within its window.
    seconds: float | None


def recovery(t0: float, end: float, ticks: Sequence[Tick],
             healthy: Callable[[Tick], bool]) -> Recovery:
    """From ``t0`` until ``healthy`` holds from some tick to the end of the window."""
    window = [t for t in ticks if t0 <= t.t < end]
    bad = [t for t in window if not healthy(t)]
    if not bad:
        return Recovery(False, 0.0)
    after = [t for t in window if t.t > bad[-1].t]
    return Recovery(True, round(after[0].t - t0, 1) if after else None)


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {name: round(value, 1) for name, value in spread(values)._asdict().items()}


def requests_summary(entries: Sequence[Entry]) -> dict[str, Any]:
    outcomes = Counter(e.verdict.outcome if e.verdict else Outcome.UNANSWERED for e in entries)
    by_kind = Counter(f"{e.model} {'stream' if e.stream else 'chat'}" for e in entries)
    unanswered = [e for e in entries
                  if e.verdict is None or e.verdict.outcome is Outcome.UNANSWERED]
    return {
        "sent": len(entries),
        "ok": outcomes[Outcome.OK],
        "errors": outcomes[Outcome.ERROR],
        "unanswered": len(unanswered),
        "by_model_and_kind": dict(sorted(by_kind.items())),
        "unanswered_list": [
            {"seq": e.seq, "model": e.model, "stream": e.stream,
             "kind": e.verdict.kind if e.verdict else "no verdict at all",
             "reason": e.verdict.reason if e.verdict else ""}
            for e in unanswered[:LISTED_UNANSWERED]],
    }


def failed_list(entries: Sequence[Entry], t_start: float) -> list[dict[str, Any]]:
    """Every request that did not get its answer, for a closer look (the JSON only)."""
    return [{"seq": e.seq, "sent_s": round(e.sent - t_start, 3),
             "took_s": None if e.ended is None else round(e.ended - e.sent, 3),
             "model": e.model, "stream": e.stream,
             "kind": e.verdict.kind if e.verdict else "no verdict",
             "reason": e.verdict.reason[:REASON_CHARS_KEPT] if e.verdict else ""}
            for e in entries if e.verdict is None or e.verdict.outcome is not Outcome.OK
            ][:FAILED_KEPT]


def errors_summary(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    """Errors by kind, most frequent first, each with its status and its commonest reason."""
    kinds: dict[str, list[Entry]] = defaultdict(list)
    for e in entries:
        if e.verdict is not None and e.verdict.outcome is Outcome.ERROR:
            kinds[e.verdict.kind].append(e)
    rows = []
    for kind, group in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        reasons = Counter(e.verdict.reason for e in group if e.verdict)
        statuses = Counter(e.verdict.status for e in group if e.verdict)
        rows.append({"kind": kind, "count": len(group),
                     "status": statuses.most_common(1)[0][0],
                     "stream": sum(e.stream for e in group),
                     "reason": reasons.most_common(1)[0][0],
                     "reasons": len(reasons)})
    return rows


def faults_summary(faults: Sequence[Fault], ticks: Sequence[Tick], entries: Sequence[Entry],
                   end: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each fault with its recovery and the failed requests sent in its window; and per
    kind, the count and recovery min/median/max."""
    rows = []
    starts = [f.t0 for f in faults[1:]] + [end]
    for fault, until in zip(faults, starts, strict=True):
        served = recovery(fault.t0, until, ticks, lambda t: t.serving)
        status = recovery(fault.t0, until, ticks, lambda t: t.api_serving)
        # By when they ended: a request held through one fault fails at the next.
        failed = Counter(e.verdict.kind if e.verdict else "no verdict" for e in entries
                         if e.verdict is None or (e.verdict.outcome is not Outcome.OK
                                                  and e.ended is not None
                                                  and fault.t0 <= e.ended < until))
        rows.append({"index": fault.index, "kind": fault.kind.value, "target": fault.target,
                     "wall": round(fault.wall, 3), "held_s": round(fault.held_s, 1),
                     "detail": fault.detail, "refused": fault.refused,
                     "interrupted": served.interrupted, "serving_again_s": served.seconds,
                     "api_serving_again_s": status.seconds,
                     "settled": fault.settled, "settle_s": round(fault.settle_s, 1),
                     "unsettled_why": fault.unsettled_why, "claims": fault.claims,
                     "failed_requests": dict(failed.most_common()), **fault.extra})
    per_kind: dict[str, Any] = {}
    for kind in FaultKind:
        mine = [r for r in rows if r["kind"] == kind.value]
        if not mine:
            continue
        done = [r for r in mine if not r["refused"]]
        back = [r["serving_again_s"] for r in done if r["serving_again_s"] is not None]
        api_back = [r["api_serving_again_s"] for r in done
                    if r["api_serving_again_s"] is not None]
        per_kind[kind.value] = {
            "count": len(mine), "refused": len(mine) - len(done),
            "interrupted": sum(r["interrupted"] for r in done),
            "not_recovered_in_window": sum(r["serving_again_s"] is None for r in done),
            "serving_again_s": _stats(back), "api_serving_again_s": _stats(api_back),
            "held_s": _stats([r["held_s"] for r in done]),
        }
    return rows, per_kind


def judge_probes(ticks: Sequence[Tick]) -> list[tuple[Probe, bool | None]]:
    """Each probe with whether it agrees (:meth:`Probe.agrees`), given the first reading of
    its deployment after it ended."""
    times = [t.t for t in ticks]
    judged = []
    for tick in ticks:
        for probe in tick.probes:
            j = bisect.bisect_left(times, probe.ended)
            later = next((p for p in ticks[j].probes if p.model == probe.model), None) \
                if j < len(ticks) else None
            judged.append((probe, probe.agrees(later)))
    return judged


def latency_summary(entries: Sequence[Entry]) -> dict[str, dict[str, float]]:
    """Seconds from send to the whole answer, of the answered requests, per model."""
    by_model: dict[str, list[float]] = defaultdict(list)
    for e in entries:
        if e.verdict is not None and e.verdict.outcome is Outcome.OK and e.ended is not None:
            by_model[e.model].append(e.ended - e.sent)
    out = {}
    for model, times in sorted(by_model.items()):
        out[model] = {"p50": round(percentile(times, 0.50), 3),
                      "p99": round(percentile(times, 0.99), 3), "max": round(max(times), 3)}
    return out


def episodes_summary(episodes: Sequence[Episode], faults: Sequence[Fault],
                     end: float) -> dict[str, Any]:
    """Each span in which a claim and an engine disagreed, with the fault it began after
    and how long it outlived that fault's end; those past their limit are leaks."""
    rows: list[dict[str, Any]] = []
    for ep in episodes:
        cause = next((f for f in reversed(faults) if f.t0 <= ep.first), None)
        since = max(ep.first, cause.t0 + cause.held_s) if cause else ep.first
        beyond = ep.last - since
        rows.append({"what": ep.what, "replica_id": ep.replica_id, "node_id": ep.node_id,
                     "lasted_s": round(ep.last - ep.first, 1),
                     "after_fault": f"{cause.index} ({cause.kind.value})" if cause else None,
                     "beyond_fault_end_s": round(beyond, 1),
                     "open_at_end": end - ep.last < 2 * CLAIM_SCAN_S,
                     "leak": beyond > EPISODE_LIMITS_S[ep.what]})
    per_what = {}
    for what in EPISODE_LIMITS_S:
        mine = [r for r in rows if r["what"] == what]
        per_what[what] = {"episodes": len(mine), "leaks": sum(r["leak"] for r in mine),
                          "limit_s": EPISODE_LIMITS_S[what],
                          "longest_s": max((r["lasted_s"] for r in mine), default=0.0)}
    return {"by_kind": per_what, "leaks": sum(r["leak"] for r in rows), "episodes": rows}


def truth_summary(ticks: Sequence[Tick]) -> dict[str, Any]:
    judged = judge_probes(ticks)
    probes = [p for p, _ in judged]
    compared = [(p, ok) for p, ok in judged if ok is not None]
    agree = sum(bool(ok) for _, ok in compared)
    wrong = [p for p, ok in compared if not ok]
    return {
        "probes": len(probes), "compared": len(compared), "agree": agree,
        "share": round(agree / len(compared), 5) if compared else None,
        "api_ready_gateway_failed": sum(bool(p.api_says_servable) for p in wrong),
        "api_not_ready_gateway_served": sum(not p.api_says_servable for p in wrong),
        "api_unanswered": sum(p.ready is None for p in probes),
        "gateway_down": sum(p.served is None for p in probes),
        "disagreement_reasons": dict(Counter(
            f"API {p.status}/{p.ready} ready, gateway {'served' if p.served else p.why}"
            for p in wrong).most_common(8)),
    }


def claims_summary(checks: Sequence[ClaimCheck]) -> dict[str, Any]:
    settled = [c for c in checks if c.settled]
    return {
        "checks": len(checks), "settled": len(settled),
        "settled_mismatches": sum(not c.match for c in settled),
        "unsettled_mismatches": sum(not c.match for c in checks if not c.settled),
        "leaked_claims": sum(len(c.leaked) for c in settled),
        "orphan_engines": sum(len(c.orphans) for c in settled),
        "mismatches": [c.as_dict() for c in checks if not c.match],
    }


def resources_summary(samples: Sequence[Usage]) -> dict[str, dict[str, float]]:
    by_name: dict[str, list[Usage]] = defaultdict(list)
    for s in samples:
        by_name[s.name].append(s)
    mib = float(1 << 20)
    return {name: {"samples": len(group),
                   "cpu_mean_percent": round(statistics.fmean(s.cpu_percent for s in group), 1),
                   "cpu_max_percent": round(max(s.cpu_percent for s in group), 1),
                   "rss_max_mib": round(max(s.rss_bytes for s in group) / mib, 1),
                   "rss_last_mib": round(group[-1].rss_bytes / mib, 1)}
            for name, group in by_name.items()}


# -- markdown ----------------------------------------------------------------------------


def _secs(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['min']:.1f} / {stats['median']:.1f} / {stats['max']:.1f}"


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _scale_mark(ok: bool, quick: bool) -> str:
    """A target of the committed run's size: not one a --quick run can meet."""
    return "n/a (--quick)" if quick else _mark(ok)


def render(result: dict[str, Any]) -> str:
    meta, req, truth, claims = (result["meta"], result["requests"], result["status_truth"],
                                result["claims"])
    episodes = result["claim_episodes"]
    per_kind = result["faults_by_kind"]
    faults_done = sum(k["count"] - k["refused"] for k in per_kind.values())
    end = result["end"]
    lines = [
        "# Soak: continuous load through repeated faults", "",
        f"`{meta['command']}` on {meta['date']}: {meta['cores']} cores, Python "
        f"{meta['python']}, code {meta['code']}. Seed **{meta['seed']}** (rerun with "
        f"`--seed {meta['seed']}` for the same faults in the same order).", "",
        f"{meta['agents']} agents declaring {meta['node_memory']} each, "
        f"{meta['workers']} control workers, {meta['clients']} clients each sending one "
        f"request every {meta['pace_s']:.2f} s ({meta['stream_share']:.0%} streamed), "
        f"a fault every {meta['gap_s'][0]:.0f}-{meta['gap_s'][1]:.0f} s. "
        f"Deployments: {', '.join(meta['deployments'])}. Settings: the defaults; the only "
        f"MODELKEEPER_* variables the components get besides where the servers are: "
        f"{', '.join(meta['changed_settings']) or 'none'} (none of them a timing).",
        "",
        f"Partitions: {meta['partition']}", "",
        "![timeline](" + meta["png"] + ")", "",
        "## Against the targets", "",
        "| | measured | target | |", "|---|---:|---:|---|",
        f"| duration | {result['duration_s'] / 60:.1f} min | | |",
        f"| requests | {req['sent']:,} | ≥ {TARGET_REQUESTS:,} (committed run) | "
        f"{_scale_mark(req['sent'] >= TARGET_REQUESTS, meta['quick'])} |",
        f"| faults | {faults_done} | ≥ {TARGET_FAULTS} (committed run) | "
        f"{_scale_mark(faults_done >= TARGET_FAULTS, meta['quick'])} |",
        f"| requests with neither a result nor an error | {req['unanswered']} | 0 | "
        f"{_mark(req['unanswered'] == 0)} |",
        f"| status truth | {_pct(truth['share'])} | ≥ {TARGET_STATUS_TRUTH:.1%} | "
        f"{_mark((truth['share'] or 0) >= TARGET_STATUS_TRUTH)} |",
        f"| settled claim checks that did not match | {claims['settled_mismatches']} of "
        f"{claims['settled']} | 0 | {_mark(claims['settled_mismatches'] == 0)} |",
        f"| claims with no engine once settled (leaked claims) | {claims['leaked_claims']} | "
        f"0 | {_mark(claims['leaked_claims'] == 0)} |",
        f"| claim and engine disagreeing past their limit | {episodes['leaks']} | 0 | "
        f"{_mark(episodes['leaks'] == 0)} |",
        f"| every deployment serving at the end | "
        f"{'yes' if end['settled'] else 'no: ' + _cell(end['why'])} | yes | "
        f"{_mark(end['settled'])} |",
        "",
        "## Requests", "",
        f"{req['sent']:,} sent: {req['ok']:,} answered, {req['errors']:,} errors, "
        f"**{req['unanswered']} unanswered**.", "",
        "| model and kind | sent |", "|---|---:|",
        *[f"| {k} | {v:,} |" for k, v in req["by_model_and_kind"].items()], "",
        "Seconds from send to the whole answer, answered requests:", "",
        "| model | p50 | p99 | max |", "|---|---:|---:|---:|",
        *[f"| {m} | {v['p50']:.3f} | {v['p99']:.3f} | {v['max']:.3f} |"
          for m, v in result["latency"].items()], "",
    ]
    if req["unanswered_list"]:
        lines += ["Unanswered requests:", "",
                  *[f"- #{u['seq']} {u['model']} {'stream' if u['stream'] else 'chat'}: "
                    f"{u['kind']} ({u['reason']})" for u in req["unanswered_list"]], ""]
    lines += ["## Errors by kind", "",
              "Each kind with its HTTP status (none: no HTTP answer) and its commonest reason.",
              "", "| kind | status | count | streamed | reason |", "|---|---:|---:|---:|---|",
              *[f"| {e['kind']} | {e['status'] or '-'} | {e['count']:,} | {e['stream']:,} | "
                f"{_cell(e['reason'])}{_others(e['reasons'] - 1)} |" for e in result["errors"]],
              ""]
    lines += ["## Faults, and time to serving again", "",
              "Serving again: every deployment has a ready replica and answers a probe "
              "through the gateway, for good within the fault's window (s, min / median / "
              "max; 0 when no tick failed). API serving again: the API shows every "
              "deployment serving, every replica it wants ready. Held: how long the fault "
              "lasted (frozen, cut off, down, restarting, or the operation running).", "",
              "| fault | what it does | count | refused | interrupted | serving again | "
              "API serving again | held (s) |", "|---|---|---:|---:|---:|---|---|---|"]
    for kind, k in per_kind.items():
        lines.append(
            f"| {kind} | {DESCRIPTIONS[FaultKind(kind)]} | {k['count']} | {k['refused']} | "
            f"{k['interrupted']}{_not_in_window(k['not_recovered_in_window'])} | "
            f"{_secs(k['serving_again_s'])} | {_secs(k['api_serving_again_s'])} | "
            f"{_secs(k['held_s'])} |")
    lines += ["", "## Status truth", "",
              f"{truth['compared']:,} probes compared (one per deployment per second): "
              f"**{_pct(truth['share'])}** agree. The API said a replica was ready but the "
              f"gateway could not serve: {truth['api_ready_gateway_failed']}; the API said "
              f"none was ready but the gateway served: {truth['api_not_ready_gateway_served']}. "
              f"Not compared: {truth['api_unanswered']} while the API did not answer, "
              f"{truth['gateway_down']} while the gateway process was down.", ""]
    if truth["disagreement_reasons"]:
        lines += ["| disagreement | probes |", "|---|---:|",
                  *[f"| {_cell(k)} | {v} |" for k, v in truth["disagreement_reasons"].items()],
                  ""]
    lines += ["## Memory claimed against memory held", "",
              f"{claims['checks']} checks (after each fault, once settled or after a bounded "
              f"wait, and at the end); {claims['settled']} settled. Settled checks that did "
              f"not match: **{claims['settled_mismatches']}** ({claims['leaked_claims']} "
              f"claim(s) with no engine, {claims['orphan_engines']} engine(s) with no claim). "
              f"Unsettled checks that did not match (a fault still in progress): "
              f"{claims['unsettled_mismatches']}. Settled means: no operation running, every "
              f"deployment serving on ready replicas only, every node ready, for "
              f"{SETTLE_STABLE_S:.0f} s in a row. An engine with no claim once settled is one "
              "the control plane gave up on while its node was cut off or frozen: it released "
              "the claim, and the engine runs until its agent's orphan reaper stops it, "
              f"{ORPHAN_GRACE_S:.0f} s (`orphan_grace_s`) after the node is back.", ""]
    for m in claims["mismatches"]:
        lines.append(f"- after {m['after']} ({'settled' if m['settled'] else 'unsettled'}): "
                     f"claims with no engine {_brief(m['leaked'])}, engines with no claim "
                     f"{_brief(m['orphans'])}, replicas with no claim {_brief(m['unclaimed'])}"
                     f"{', error ' + m['error'] if m['error'] else ''}")
    lines += ["", f"Between faults the claims were compared with the engines every "
              f"{CLAIM_SCAN_S:.0f} s. Each span of disagreement, and how long it outlived the "
              "end of the fault it began after (a leak past the limit: a dead replica's claim "
              f"stays until it is declared lost, limit {CLAIM_LIMIT_S:.0f} s; an engine the "
              "control plane gave up on runs until its agent's orphan reaper stops it, "
              f"limit {ORPHAN_LIMIT_S:.0f} s):", "",
              "| disagreement | spans | longest (s) | leaks |", "|---|---:|---:|---:|",
              *[f"| {w} | {k['episodes']} | {k['longest_s']:.0f} | {k['leaks']} |"
                for w, k in episodes["by_kind"].items()], ""]
    long_ones = [e for e in episodes["episodes"] if e["beyond_fault_end_s"] > CLAIM_SCAN_S]
    if long_ones:
        lines += ["| disagreement | replica | after fault | lasted (s) | beyond the fault's "
                  "end (s) | leak |", "|---|---|---|---:|---:|---|",
                  *[f"| {e['what']} | {e['replica_id']} | {e['after_fault']} | "
                    f"{e['lasted_s']:.0f} | {e['beyond_fault_end_s']:.0f} | "
                    f"{'**yes**' if e['leak'] else 'no'}"
                    f"{' (still open at the end)' if e['open_at_end'] else ''} |"
                    for e in long_ones], ""]
    lines += ["", "## Control-plane processes", "",
              "CPU in percent of one core (whole process group), resident memory in MiB.", "",
              "| process | CPU mean | CPU max | RSS max | RSS at the end |",
              "|---|---:|---:|---:|---:|",
              *[f"| {n} | {r['cpu_mean_percent']} | {r['cpu_max_percent']} | "
                f"{r['rss_max_mib']} | {r['rss_last_mib']} |"
                for n, r in result["resources"].items()], ""]
    lines += ["## Every fault", "",
              "| # | at (s) | fault | target | held (s) | serving again (s) | settled | claims | "
              "failed requests in its window | detail |",
              "|---:|---:|---|---|---:|---:|---|---|---|---|"]
    t_start = meta["started_wall"]
    for f in result["faults"]:
        claims_ok = "-" if f["claims"] is None else ("match" if f["claims"]["match"]
                                                     else "**mismatch**")
        again = "-" if f["refused"] else (
            "not in window" if f["serving_again_s"] is None else f"{f['serving_again_s']:.1f}")
        lines.append(
            f"| {f['index']} | {f['wall'] - t_start:.0f} | {f['kind']} | {f['target']} | "
            f"{f['held_s']:.1f} | {again} | "
            f"{'yes' if f['settled'] else 'no: ' + _cell(f['unsettled_why'])} "
            f"({f['settle_s']:.0f} s) | {claims_ok} | "
            f"{_cell(', '.join(f'{k}: {v}' for k, v in f['failed_requests'].items()))} | "
            f"{_cell('refused: ' + f['refused'] if f['refused'] else f['detail'])} |")
    lines += ["", "Rerun: `" + meta["command"] + "`", ""]
    return "\n".join(lines)


def _others(count: int) -> str:
    return f" (+{count} other)" if count > 0 else ""


def _not_in_window(count: int) -> str:
    return f" ({count} not in window)" if count else ""


def _brief(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['replica_id']}@{r['node_id']}" for r in rows) or "none"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.2%}"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")[:240]


# -- timeline -------------------------------------------------------------------------------


def timeline(entries: Sequence[Entry], ticks: Sequence[Tick], t_start: float,
             t_end: float) -> dict[str, Any]:
    """Per-second series from ``t_start``: answers, errors by kind, ready replicas."""
    seconds = max(1, int(t_end - t_start) + 1)
    ok = [0] * seconds
    errors: dict[str, list[int]] = defaultdict(lambda: [0] * seconds)
    for e in entries:
        if e.ended is None or e.verdict is None:
            continue
        i = int(e.ended - t_start)
        if not 0 <= i < seconds:
            continue
        if e.verdict.outcome is Outcome.OK:
            ok[i] += 1
        else:
            errors[e.verdict.kind][i] += 1
    ready: dict[str, list[int | None]] = defaultdict(lambda: [None] * seconds)
    for tick in ticks:
        i = int(tick.t - t_start)
        if 0 <= i < seconds:
            for p in tick.probes:
                ready[p.model][i] = p.ready
    return {"ok": ok, "errors": dict(errors), "ready": dict(ready)}


def draw(series: dict[str, Any], faults: Sequence[dict[str, Any]], t_start_wall: float,
         path: Path) -> None:
    """The PNG: answers and errors per second, errors by kind, ready replicas, faults."""
    import matplotlib
    matplotlib.use("Agg")  # no display: draw to a file
    import matplotlib.pyplot as plt

    seconds = len(series["ok"])
    xs = list(range(seconds))
    fig, (ax_rps, ax_err, ax_ready) = plt.subplots(3, 1, figsize=(14, 9), sharex=True,
                                                   height_ratios=[2, 2, 1.5])
    failed = [sum(v[i] for v in series["errors"].values()) for i in xs]
    ax_rps.plot(xs, series["ok"], lw=0.6, color="tab:green", label="answered")
    ax_rps.plot(xs, failed, lw=0.6, color="tab:red", label="errors and unanswered")
    ax_rps.set_ylabel("requests / s")
    ax_rps.legend(loc="upper right", fontsize=8)

    totals = Counter({k: sum(v) for k, v in series["errors"].items()})
    shown = [k for k, _ in totals.most_common(PLOTTED_KINDS)]
    bins = list(range(0, seconds, ERROR_BIN_S))

    def binned(values: Sequence[int]) -> list[float]:
        return [sum(values[b:b + ERROR_BIN_S]) / ERROR_BIN_S for b in bins]
    for kind in shown:
        ax_err.step(bins, binned(series["errors"][kind]), where="post", lw=0.8, label=kind)
    rest = [sum(series["errors"][k][i] for k in series["errors"] if k not in shown) for i in xs]
    if any(rest):
        ax_err.step(bins, binned(rest), where="post", lw=0.8, color="grey", label="other")
    ax_err.set_ylabel(f"errors / s ({ERROR_BIN_S} s bins)")
    if shown:
        ax_err.legend(loc="upper right", fontsize=7)

    for model, values in sorted(series["ready"].items()):
        ax_ready.step(xs, [float("nan") if v is None else v for v in values], where="post",
                      lw=0.9, label=model)
    ax_ready.set_ylabel("ready replicas")
    ax_ready.set_xlabel("seconds since the clients started")
    ax_ready.legend(loc="upper right", fontsize=7)

    colours = {kind.value: plt.get_cmap("tab20")(i) for i, kind in enumerate(FaultKind)}
    for f in faults:
        x = f["wall"] - t_start_wall
        for ax in (ax_rps, ax_err, ax_ready):
            ax.axvline(x, color=colours[f["kind"]], lw=0.8, alpha=0.8,
                       ls=":" if f["refused"] else "-")
        ax_rps.text(x, 1.0, f" {f['kind']}", transform=ax_rps.get_xaxis_transform(),
                    rotation=90, va="top", fontsize=6, color=colours[f["kind"]])
    ax_rps.set_title("Soak timeline (vertical lines: faults; dotted: refused)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
