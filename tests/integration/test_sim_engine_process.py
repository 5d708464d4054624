"""The sim engine as a real process, started from its adapter's launch plan.

Every test waits on the engine's own signals (``/health``, its exit code), never on a
fixed sleep, and stops what it started in ``finally``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from agent.engines.sim import SimAdapter
from agent.engines.sim_server import CRASH_EXIT_CODE, FAIL_AT_START_EXIT_CODE
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.infra.processes import ManagedProcess, ProcessExitedError, free_port, tcp_accepts

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-tiny"
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
HOST = "127.0.0.1"
#: Generous: 20 interpreters starting at once on a 2-core machine share the CPUs.
READY_TIMEOUT_S = 30.0


class Sim:
    """A started sim engine process and its base URL."""

    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://{HOST}:{port}"

    def health(self, timeout: float = 1.0) -> int | None:
        """The /health status, or None when nothing answers in time."""
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self) -> None:
        self.process.wait_until(lambda: self.health() == 200, timeout=READY_TIMEOUT_S)

    def wait_exit(self, timeout: float = 20.0) -> int:
        """The exit code, once the process has ended by itself."""
        deadline = time.monotonic() + timeout
        while (code := self.process.poll()) is None:
            assert time.monotonic() < deadline, f"still running; log:\n{self.process.log_tail()}"
            time.sleep(0.05)
        return code


def launch(tmp_path: Path, name: str = "sim", **engine_args: Any) -> Sim:
    """Start a sim engine the way the agent would: from SimAdapter's launch plan."""
    port = free_port()
    spec = ShardSpec(
        replica_id=ReplicaId(f"r-{name}"),
        model_id=ModelId(MODEL),
        node_id=NodeId("n1"),
        engine=EngineKind.SIM,
        source="sim",
        memory_bytes=engine_args.pop("memory_bytes", 0),
        engine_args=engine_args,
    )
    plan = SimAdapter().launch_plan(spec, host=HOST, port=port, api_key=KEY)
    process = ManagedProcess(
        name, plan.argv, tmp_path / f"{name}.log", env={**os.environ, **plan.env}
    )
    process.start()
    return Sim(process, port)


@contextmanager
def running(tmp_path: Path, name: str = "sim", **engine_args: Any) -> Iterator[Sim]:
    sim = launch(tmp_path, name, **engine_args)
    try:
        yield sim
    finally:
        sim.process.stop()


def sse_payloads(response: httpx.Response) -> list[str]:
    """The data of each server-sent event in a streamed response."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


def test_serves_models_chat_and_completions_and_stops_cleanly(tmp_path: Path) -> None:
    with running(tmp_path) as sim:
        sim.wait_healthy()
        with httpx.Client(base_url=sim.url, headers=AUTH, timeout=5) as client:
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == [MODEL]

            chat = client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
                      "max_tokens": 4},
            )  # fmt: skip
            assert chat.status_code == 200, chat.text
            body = chat.json()
            assert body["object"] == "chat.completion"
            assert body["model"] == MODEL
            assert body["choices"][0]["message"] == {
                "role": "assistant", "content": "the quick brown fox"
            }  # fmt: skip
            assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}

            text = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once"}).json()
            assert text["object"] == "text_completion"
            assert len(text["choices"][0]["text"].split()) == 16  # the default max_tokens
            assert text["id"] != body["id"]

        code = sim.process.stop()
        assert code == 0
        assert "shutting down" in sim.process.log_tail()


def test_streaming_ends_with_done(tmp_path: Path) -> None:
    with running(tmp_path) as sim:
        sim.wait_healthy()
        with httpx.Client(base_url=sim.url, headers=AUTH, timeout=5) as client:
            request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 6, "stream": True}  # fmt: skip
            with client.stream("POST", "/v1/chat/completions", json=request) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                payloads = sse_payloads(response)
            assert payloads[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            assert content == "the quick brown fox jumps over"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

            request = {"prompt": "Hi", "max_tokens": 3, "stream": True}
            with client.stream("POST", "/v1/completions", json=request) as response:
                payloads = sse_payloads(response)
            assert payloads[-1] == "[DONE]"
            text = "".join(json.loads(p)["choices"][0]["text"] for p in payloads[:-1])
            assert text == "the quick brown"

            # The same keep-alive connection still serves a plain request after streams.
            assert client.get("/v1/models").status_code == 200


def test_api_key_guards_v1_but_not_health(tmp_path: Path) -> None:
    with running(tmp_path) as sim:
        sim.wait_healthy()
        with httpx.Client(base_url=sim.url, timeout=5) as client:
            assert client.get("/health").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
                assert response.status_code == 401
                assert response.json()["error"]["message"]
            assert client.get("/v1/models").status_code == 401


def test_tokens_per_second_paces_generation(tmp_path: Path) -> None:
    with running(tmp_path, tokens_per_second=50) as sim:
        sim.wait_healthy()
        with httpx.Client(base_url=sim.url, headers=AUTH, timeout=5) as client:
            started = time.monotonic()
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10})
            assert time.monotonic() - started >= 0.2 * 0.9  # 10 tokens at 50/s

            arrivals = []
            request = {"prompt": "x", "max_tokens": 10, "stream": True}
            with client.stream("POST", "/v1/completions", json=request) as response:
                for line in response.iter_lines():
                    if line:
                        arrivals.append(time.monotonic())
            # Tokens trickle in over ~0.2 s instead of arriving in one burst.
            assert arrivals[-1] - arrivals[0] >= 0.15


def test_load_time_answers_503_then_200(tmp_path: Path) -> None:
    load_time = 3.0
    with running(tmp_path, load_time_s=load_time) as sim:
        started = time.monotonic()
        sim.process.wait_until(lambda: tcp_accepts(HOST, sim.port), timeout=READY_TIMEOUT_S)
        response = httpx.get(sim.url + "/health", timeout=5)
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "Loading model"
        loading = httpx.post(sim.url + "/v1/completions", json={"prompt": "x"}, headers=AUTH)
        assert loading.status_code == 503

        sim.wait_healthy()
        # Measured from our side, after the interpreter started; the engine's own clock
        # starts earlier, so this is a lower bound with slack for that start-up.
        assert time.monotonic() - started >= load_time - 1.5
        assert "ready after" in sim.process.log_tail()


def test_fail_at_start_exits_1_without_being_healthy(tmp_path: Path) -> None:
    with running(tmp_path, fail_at_start=True, load_time_s=0.5) as sim:
        with pytest.raises(ProcessExitedError):
            sim.wait_healthy()
        assert sim.wait_exit() == FAIL_AT_START_EXIT_CODE
        assert "simulated failure while loading" in sim.process.log_tail()


def test_crash_after_exits_with_the_crash_code(tmp_path: Path) -> None:
    with running(tmp_path, crash_after_s=1.5) as sim:
        sim.wait_healthy()
        assert sim.wait_exit() == CRASH_EXIT_CODE
        assert "simulated crash" in sim.process.log_tail()


def test_hang_accepts_but_never_answers(tmp_path: Path) -> None:
    with running(tmp_path, hang=True) as sim:
        sim.process.wait_until(lambda: tcp_accepts(HOST, sim.port), timeout=READY_TIMEOUT_S)
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(sim.url + "/health", timeout=1.0)
        assert sim.process.poll() is None
        # Hung on the HTTP side only: SIGTERM still ends it cleanly.
        assert sim.process.stop() == 0


def test_memory_bytes_is_held_resident(tmp_path: Path) -> None:
    target = 96 * 1024 * 1024
    with running(tmp_path, memory_bytes=target) as sim:
        sim.wait_healthy()
        rss = psutil.Process(sim.process.pid).memory_info().rss
        # The sim tops up to the target, so the interpreter's own pages count toward it.
        assert target * 0.95 <= rss <= target + 16 * 1024 * 1024, rss


def test_twenty_engines_at_once_stay_small(tmp_path: Path) -> None:
    count = 20
    sims: list[Sim] = []
    try:
        started = time.monotonic()
        sims = [launch(tmp_path, f"sim{i}") for i in range(count)]
        ready_after: dict[int, float] = {}
        deadline = started + READY_TIMEOUT_S
        while len(ready_after) < count:
            assert time.monotonic() < deadline, f"ready: {sorted(ready_after)}"
            for i, sim in enumerate(sims):
                if i in ready_after:
                    continue
                assert sim.process.poll() is None, sim.process.log_tail()
                if sim.health(timeout=0.5) == 200:
                    ready_after[i] = time.monotonic() - started
            time.sleep(0.02)

        with httpx.Client(headers=AUTH, timeout=10) as client:
            for sim in sims:
                response = client.post(
                    sim.url + "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                )
                assert response.status_code == 200
                assert response.json()["choices"][0]["message"]["content"] == "the quick"

        rss = [psutil.Process(sim.process.pid).memory_info().rss for sim in sims]
        uss = [psutil.Process(sim.process.pid).memory_full_info().uss for sim in sims]
        mib = 1024 * 1024
        print(
            f"\n{count} sim engines: RSS max {max(rss) / mib:.1f} MiB, "
            f"mean {sum(rss) / count / mib:.1f} MiB, total {sum(rss) / mib:.0f} MiB; "
            f"USS mean {sum(uss) / count / mib:.1f} MiB, total {sum(uss) / mib:.0f} MiB; "
            f"start-to-ready min {min(ready_after.values()):.2f}s "
            f"max {max(ready_after.values()):.2f}s"
        )
        assert max(rss) < 40 * mib
    finally:
        for sim in sims:
            sim.process.stop()
