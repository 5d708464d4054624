"""Tunables: the timings and limits of modelkeeper, each default and its reason in one place.

Pure values (no I/O). ``modelkeeper.settings.Settings`` inherits the groups an operator may
set from the environment (``MODELKEEPER_<FIELD>``), so their defaults live here and only
here; ``tests/unit/test_settings.py`` compares the two.

:class:`Tunables` is what one deployment runs with: the keeper group (from settings) plus
the workflow's timeouts and the keeper's finer limits, fixed in code. The API sends it in
the deployment workflow's start input, and the workflow builds its state (its
``KeeperConfig`` included) from it, so a workflow started without the API gets the same
defaults. Continue-as-new carries it, so a run keeps what it started with.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from .base import Tolerant
from .demand import MAX_LOAD_WAIT_S


class KeeperTunables(Tolerant):
    """What an operator may set for every deployment (Settings reads these)."""

    watch_heartbeat_timeout_s: float = Field(
        default=60.0, gt=0,
        description="A replica whose watch misses heartbeats this long is unreachable "
        "(routed around). Only a backstop for when the API is down: node liveness notices "
        "a dead node within node_silent_after_s. At 60 s the SDK sends one heartbeat per "
        "48 s, about 75 Temporal RPCs per shard-hour.",
    )
    replica_lost_after_s: float = Field(
        default=15.0, gt=0,
        description="An unreachable replica whose agent has not vouched for it this long "
        "is lost and placed again. Outlasts an agent restart and a short network blip.",
    )
    start_backoff_initial_s: float = Field(
        default=10.0, gt=0, description="Wait after the first failed start (doubles).")
    start_backoff_max_s: float = Field(
        default=60.0, gt=0, description="Longest wait between failed starts.")
    park_after_failures: int = Field(
        default=5, ge=1, description="Failed starts in a row before a deployment is parked.")
    cant_place_retry_s: float = Field(
        default=30.0, gt=0,
        description="First wait before an unplaceable deployment's room watch tries a dry "
        "run of its placement (a node change retries it at once); each that still finds no "
        "room doubles the wait, up to 10 min.")
    relaunch_tries: int = Field(
        default=3, ge=0,
        description="An engine that exits after it was ready is relaunched in place (same "
        "node, same claim, its port if free, no new fetch) up to this many times within "
        "relaunch_window_s; one more exit in the window releases the replica and places it "
        "again. 3, as exo's keeper retries an instance: one crash costs a load, not a "
        "placement. 0 turns relaunching off.",
    )
    relaunch_window_s: float = Field(
        default=600.0, gt=0,
        description="The window relaunch_tries counts in (sliding): an engine that crashes "
        "more often than that is given up on its node and placed again, while one that "
        "crashes once a day is relaunched each time. 10 min holds three loads of a large "
        "model (minutes each) and their crashes.",
    )


class Tunables(KeeperTunables):
    """What one deployment runs with: the keeper group, and the rest fixed in code.

    Fields, not constants: they travel in the workflow's state (continue-as-new carries
    them). Renaming or removing one changes the state's shape, which running workflows
    must still decode.
    """

    #: A node queue nobody polls fails a start or watch this fast (a dead agent).
    node_schedule_to_start_s: float = 10.0
    #: A probe (list_shards) asks a live agent what it runs, answered in milliseconds; 2 s
    #: bounds queueing and answer alike, so probing a dead node ends fast (docs/keeper.md).
    probe_timeout_s: float = 2.0
    #: An engine not ready this long after launch is stopped by its agent and the start
    #: fails (ShardSpec.start_timeout_s, the same default): large models load for minutes.
    start_timeout_s: float = 600.0
    #: A stop sends SIGTERM, then SIGKILL after this long: time for an engine to exit
    #: cleanly, short enough that a delete or a replacement does not wait on a hung one.
    stop_grace_s: float = 10.0
    #: place_replica keeps retrying through the settling window (15 s by default) and
    #: database blips; five minutes also outlasts a database restart.
    place_schedule_to_close_s: float = 300.0
    #: Continue-as-new past this many history events even if the server has not yet
    #: suggested it; keeps replays fast. (Tests set it low to exercise the path.)
    continue_as_new_after_events: int = 10_000
    #: A graceful stop waits this long at most for a retired replica's in-flight requests
    #: (a long generation is cut off past it).
    drain_grace_s: float = 30.0
    #: A preempted replica's drain waits this long at most: a placement that outranks it
    #: waits for the room, so its requests get a short courtesy, not the full drain
    #: (a chat answer of a few hundred tokens finishes well within it; a longer one is
    #: cut off, as a drain's is past its grace).
    preempt_grace_s: float = 10.0
    #: A room watch silent this long is retried (its worker died). The SDK sends one
    #: heartbeat per 0.8 x this, at most one a minute: 60 RPCs an hour per deployment
    #: that cannot be placed, and a cancel reaches the watch within a minute.
    room_watch_heartbeat_timeout_s: float = 120.0
    #: An unreachable replica's agent is asked again this often whether it still runs it.
    probe_interval_s: float = 2.0
    #: Jitter spreads retries of many deployments failing together (a node crash takes
    #: several down at once): each wait is scaled by a factor in [1 - j/2, 1 + j/2).
    backoff_jitter: float = 0.2
    #: The room watch's longest wait between two dry runs: how late room that appears
    #: without a node change (the API down as it does) is found.
    room_watch_max_s: float = 600.0
    #: The blind retry's wait after a placement that found no room: a backstop for a room
    #: watch lost for good (its retries are Temporal's and cost no events). One an hour is
    #: 11 history events an hour.
    cant_place_backstop_s: float = 3600.0
    #: Replicas a move may place beyond the desired number at once (surge, replace).
    max_surge: int = Field(default=1, ge=1)


class ControlTunables(Tolerant):
    """The API's and the control worker's timeouts and limits (Settings reads these)."""

    preempt_hold_s: float = Field(
        default=120.0, gt=0,
        description="How long the room a preemption frees is held for the deployment that "
        "asked (counted as claimed for every other placement): the victims' drains "
        "(preempt_grace_s), their stops and its own placement fit well within it; past it, "
        "a holder that never came frees the room for the victims again.",
    )
    api_header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Longest a client of the API may take to send a request's headers (and "
        "a new connection its first request): a slow or stalled sender holds a connection "
        "no longer (a 408). Headers are at most 64 KiB (a 431 beyond).",
    )
    api_body_timeout_s: float = Field(
        default=30.0, gt=0,
        description="Longest a client of the API may take to send a request's body once "
        "its headers are in (a 408 beyond): bodies are at most 1 MiB. The agents' liveness "
        "streams, long-lived by design, are exempt once their node's credential is checked.",
    )
    registration_burst: int = Field(
        default=64, ge=1, le=1_000_000,
        description="Registrations the API accepts from one peer address at once, before "
        "registration_per_s paces it (a 429 with Retry-After). An agent registers once per "
        "start and after its node is removed, so one machine needs a few; 64 leaves room "
        "for a rack of agents behind one address restarting together. A fleet harness "
        "(`python -m bench.fleet --fleet N`, bench/scale) registers N nodes from one address at "
        "once: give the API at least N (bench/scale does).",
    )
    registration_per_s: float = Field(
        default=1.0, gt=0, le=1_000_000,
        description="Registrations a second one peer address may make once its burst is "
        "spent: a second apiece, so a looping or hostile agent adds at most 3,600 nodes "
        "an hour, each costing a row and a signal to every waiting deployment.",
    )
    settling_window_s: float = Field(
        default=15.0, ge=0,
        description="A fresh worker waits this long (or half of it with a steady node "
        "count) before placing, so agents can reconnect and report what they run.",
    )
    sweep_interval_s: float = Field(
        default=60.0, gt=0,
        description="How often the control worker sweeps away deployments whose workflow "
        "is gone (terminated, or never started): rows, replicas and claims. At 60 s a "
        "terminated deployment's memory returns to placement within about 2 minutes, for "
        "one Temporal describe per deployment per minute.",
    )
    eviction_protect_s: float = Field(
        default=300.0, ge=0,
        description="A replica that started serving less than this long ago is never "
        "evicted to make room for another on-demand model. Two on-demand models with room "
        "for one would otherwise take turns evicting each other at a model load per "
        "request; at 300 s they take turns at most once per 5 minutes.",
    )
    demand_sample_interval_s: float = Field(
        default=1.0, gt=0, le=60,
        description="How often the control worker reads the gateways' usage rows for every "
        "deployment that follows demand, in one query, and runs the scaling rules on them. "
        "The gateways write those rows once per usage_flush_interval_s (1 s), so reading "
        "faster finds nothing new; a request for a model with no replica is noticed at "
        "once (the store notifies), not on this tick.",
    )


class LivenessTunables(Tolerant):
    """How the API judges a node's liveness (Settings reads these)."""

    node_unreachable_after_s: float = Field(
        default=6.0, gt=0,
        description="A node with no heartbeat for this long is unreachable (3 missed "
        "heartbeats at the default 2 s).",
    )
    node_lost_after_s: float = Field(
        default=60.0, gt=0,
        description="A node with no heartbeat for this long is lost.",
    )
    node_silent_after_s: float = Field(
        default=1.5, gt=0,
        description="A node whose liveness stream carries no ping this long is silent: "
        "its deployments are told at once and placement skips it (3 missed pings at the "
        "default 0.5 s). A stream that breaks without a goodbye is silent at once.",
    )
    node_silent_after_max_s: float = Field(
        default=6.0, gt=0,
        description="The longest damping stretches node_silent_after_s: a node that comes "
        "back within this long of a silence (a late ping, not a crash) gets twice the "
        "deadline next time. 6 s is node_unreachable_after_s, which says the same from "
        "heartbeats, so damping never makes liveness slower than them.",
    )
    node_silent_calm_after_s: float = Field(
        default=60.0, gt=0,
        description="Each this long without a silence halves a node's stretched liveness "
        "deadline again, back down to node_silent_after_s.",
    )

    @model_validator(mode="after")
    def _damping_above_deadline(self) -> Self:
        if self.node_silent_after_max_s < self.node_silent_after_s:
            raise ValueError(
                f"node_silent_after_max_s (MODELKEEPER_NODE_SILENT_AFTER_MAX_S) = "
                f"{self.node_silent_after_max_s:g} is below node_silent_after_s = "
                f"{self.node_silent_after_s:g}: damping only stretches the liveness "
                "deadline, so its limit must be at least the deadline")
        return self


class AgentTunables(Tolerant):
    """An agent's intervals and limits (Settings reads these)."""

    heartbeat_interval_s: float = Field(
        default=2.0, gt=0, le=60, description="Seconds between an agent's heartbeats.")
    liveness_interval_s: float = Field(
        default=0.5, gt=0, le=60,
        description="Seconds between the pings on an agent's liveness stream. Keep 3 of "
        "them within the API's node_silent_after_s, so one late ping is not silence.",
    )
    orphan_grace_s: float = Field(
        default=120.0, gt=0,
        description="An agent stops a shard nobody has watched for this long (split-brain "
        "guard: the control plane declared it lost and placed it elsewhere).",
    )
    max_concurrent_startups: int = Field(
        default=1, ge=1,
        description="Engines an agent lets load at once; later starts wait their turn "
        "(first come, first served), shown as queued, and their fit is checked again "
        "when it comes. An engine sizes itself from the memory it finds while loading "
        "(vLLM asserts free memory did not change), so two loads on one node can break "
        "each other. Stops are never delayed.",
    )


class GatewayTunables(Tolerant):
    """The gateway's timeouts and limits (Settings reads these)."""

    gateway_wait_for_replica_s: float = Field(
        default=10.0, ge=0,
        description="How long after it arrives a request for a known model may wait for a "
        "replica: one that is ready, or one to retry on after a replica failed it before "
        "answering (an engine crash). Then it is answered 503 (never sent) or 502 (failed).",
    )
    gateway_load_wait_s: float = Field(
        default=30.0, ge=0, le=MAX_LOAD_WAIT_S,
        description="How long a request for a model that loads on demand (or is asleep) "
        "is held while it loads or wakes, when its scaling policy names no load_wait_s: "
        "long enough for a small model's load, short enough for a client's own timeout. "
        "Then it is answered 503 with Retry-After, \"is loading\".",
    )
    gateway_retry_after_s: int = Field(
        default=5, ge=1,
        description="Retry-After (seconds) of a 503 for a model that is still placing, "
        "starting or loading.",
    )
    gateway_retries: int = Field(
        default=2, ge=0,
        description="Times a request is sent again after a replica refuses or drops the "
        "connection before answering, counting a send to a replacement after waiting.",
    )
    gateway_connect_timeout_s: float = Field(
        default=3.0, gt=0, description="Longest wait to connect to an engine.")
    gateway_read_timeout_s: float = Field(
        default=300.0, gt=0,
        description="Longest silence from an engine (before its answer, or between two "
        "streamed chunks) before the request fails.",
    )
    gateway_breaker_failures: int = Field(
        default=5, ge=1,
        description="Failures in a row (refused, reset, 5xx, cut streams) that open a "
        "replica's circuit breaker, taking it out of routing.",
    )
    gateway_breaker_open_s: float = Field(
        default=5.0, gt=0,
        description="How long an open breaker keeps a replica out before one trial request "
        "(doubling, up to 60 s, while trials fail).",
    )
    usage_flush_interval_s: float = Field(
        default=1.0, gt=0,
        description="How often each gateway worker writes per-replica usage (in-flight, "
        "waiting, last used) to the store, in one batch.",
    )
    gateway_key_max_staleness_s: float = Field(
        default=15.0, gt=0, le=300,
        description="Longest a gateway trusts the API keys it last read from the store. "
        "It re-reads them every third of this (and at once on a change), so a revoked key "
        "stops working within it; while the store is unreachable for longer, every keyed "
        "request is refused with a 503 (fail closed) until a read succeeds again.",
    )
    gateway_max_tokens: int | None = Field(
        default=None, ge=1,
        description="Most tokens one request may ask for, for every key: a larger "
        "max_tokens (or max_completion_tokens) is a 400 naming it, and a request naming "
        "none is sent with max_tokens set to this. Unset: no bound.",
    )
    gateway_max_choices: int = Field(
        default=1, ge=1, le=128,
        description="Most outputs one request may ask for: n, best_of (vLLM, SGLang) or "
        "n_cmpl (llama.cpp), times the prompts of a /v1/completions batch. Each output "
        "may run to the max_tokens bound, so more would multiply it; over it, a 400.",
    )
    gateway_key_rate_per_s: float | None = Field(
        default=None, gt=0,
        description="Requests per second each API key may make, per gateway worker (a "
        "client's connection stays on one worker); beyond it, 429 with Retry-After. "
        "Unset: no limit.",
    )
    gateway_key_burst: int = Field(
        default=20, ge=1,
        description="Requests a key may make at once before gateway_key_rate_per_s "
        "applies (a token bucket's size).",
    )
    gateway_header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Longest a client may take to send a request's headers (and a new "
        "connection its first request): a slow or stalled sender holds a connection no "
        "longer.",
    )
    gateway_body_timeout_s: float = Field(
        default=60.0, gt=0,
        description="Longest a client may take to send a request's body once its headers "
        "are in: the largest body (32 MiB) at 1 MB/s, with room.",
    )


class WatchdogTunables(Tolerant):
    """The memory watchdog's thresholds (the agent's) and what the control plane does
    about a critical node (Settings reads these; docs/capacity.md, "The memory
    watchdog")."""

    watchdog_margin_bytes: int = Field(
        default=8 << 30, ge=0,
        description="Memory a node keeps free (bytes): available memory below it is "
        "critical, below watchdog_warn_factor times it a warning. 8 GiB, the seed's: room "
        "for a kernel's page cache and a burst of allocations while a replica is stopped. "
        "A node smaller than 10 times this uses watchdog_margin_fraction of its memory "
        "instead, so a small node is not critical for ever.",
    )
    watchdog_margin_fraction: float = Field(
        default=0.1, gt=0, lt=1,
        description="The margin of a node whose memory is under 10 x watchdog_margin_bytes, "
        "as a fraction of that memory: 10 %, about what engines' allocators overshoot "
        "their steady use by.",
    )
    watchdog_warn_factor: float = Field(
        default=1.5, gt=1,
        description="Available memory below this many margins is a warning: early enough "
        "to stop or move a replica by hand before the margin is gone.",
    )
    watchdog_clear_fraction: float = Field(
        default=0.1, ge=0, lt=1,
        description="Hysteresis: a level is left for a better one only once available "
        "memory is this fraction of the margin above that level's line, so a node hovering "
        "at a line does not flap between levels (each change is an event and an alert).",
    )
    watchdog_gpu_margin_bytes: int = Field(
        default=1 << 30, ge=0,
        description="GPU memory each GPU keeps free: below it on any GPU is critical, "
        "below watchdog_warn_factor times it a warning. 1 GiB: vLLM claims 90 % of a GPU "
        "by design, so only the last gigabyte says a process outgrew its share.",
    )
    watchdog_auto_protect: bool = Field(
        default=False,
        description="On a critical node, stop one replica (the lowest class, the largest "
        "first within it) by preempting it, at most once every "
        "watchdog_action_interval_s. Off: the watchdog only warns (events, metrics, the "
        "ModelkeeperNodeMemoryCritical alert).",
    )
    watchdog_action_interval_s: float = Field(
        default=60.0, gt=0,
        description="Least time between two stops on one node: a stopped engine frees its "
        "memory within seconds, and the next heartbeats must see that before another goes.",
    )
    oom_calibration_margin: float = Field(
        default=1.2, ge=1,
        description="A model killed for memory is placed next with its measured peak "
        "resident memory times this: the peak is what it reached when killed, not what "
        "it would have reached, so 20 % more.",
    )


class NotifyTunables(Tolerant):
    """When notifications are sent (Settings reads these; docs/operations.md,
    "Notifications")."""

    notify_cant_place_after_s: float = Field(
        default=600.0, gt=0,
        description="A deployment unplaceable this long without a break is notified "
        "(deployment.cant_place). 10 min: longer than a node's restart and the room "
        "watch's first retries, so a notice means the fleet lacks room, not that a node is "
        "rebooting.",
    )
