"""The real llama.cpp engine (xllamacpp + SmolLM2) through our entry point and adapter."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from agent.engines.base import ReadyCheck
from agent.engines.llamacpp import API_KEY_ENV, LlamaCppAdapter
from agent.engines.llamacpp_main import EXIT_USAGE
from modelkeeper.domain.engine_keys import derive_engine_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, ShardSpec
from modelkeeper.infra.processes import ManagedProcess, ProcessExitedError, free_port

pytestmark = pytest.mark.timeout(90)

SECRET = b"integration-test-secret-0123456789"
HOST = "127.0.0.1"
#: Cold start measured at about 3 s; the rest is headroom for a loaded 2-core machine.
READY_TIMEOUT_S = 60.0


async def wait_ready(
    adapter: LlamaCppAdapter, proc: ManagedProcess, base_url: str, key: str, model: str
) -> ReadyCheck:
    """Poll the adapter's readiness check until it passes, the process dies, or time's up."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_TIMEOUT_S
    async with httpx.AsyncClient() as client:
        while True:
            code = proc.poll()
            if code is not None:
                raise ProcessExitedError(f"engine exited with {code}:\n{proc.log_tail()}")
            check = await adapter.check_ready(client, base_url, key, model)
            if check.ready:
                return check
            if loop.time() > deadline:
                raise TimeoutError(f"not ready: {check.detail}\n{proc.log_tail()}")
            await asyncio.sleep(0.1)


async def test_engine_serves_with_its_key_and_only_with_it(tmp_path: Path) -> None:
    spec = ShardSpec(
        replica_id=ReplicaId("rep-int-1"),
        model_id=ModelId("smol"),
        node_id=NodeId("node-a"),
        engine=EngineKind.LLAMACPP,
        source="smollm2",
        memory_bytes=512 * 2**20,
        # Two cores reserved: llama.cpp itself must say it runs two threads (below).
        cpu_cores=2.0,
        engine_args={"ctx_size": 2048, "parallel": 2},
    )
    key = derive_engine_key(SECRET, spec.replica_id)
    port = free_port(HOST)
    adapter = LlamaCppAdapter()
    plan = adapter.launch_plan(spec, host=HOST, port=port, api_key=key)
    base_url = f"http://{HOST}:{port}"
    # cwd elsewhere: the agent may run from any directory.
    proc = ManagedProcess(
        "llamacpp-test", plan.argv, tmp_path / "engine.log", env={**os.environ, **plan.env},
        cwd=tmp_path,
    )  # fmt: skip
    proc.start()
    exit_code: int | None = None
    try:
        check = await wait_ready(adapter, proc, base_url, key, spec.model_id)
        assert "/health 200" in check.detail
        # The replica's reserved cores are the engine's threads, as llama.cpp logs them
        # when it sets up its thread pool.
        assert "n_threads = 2" in (tmp_path / "engine.log").read_text(), proc.log_tail()

        # Everyone on the node can read this; the key must not be in it.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "llamacpp_main" in cmdline

        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            health = await client.get(plan.health_path)
            assert health.status_code == 200

            chat = await client.post(
                "/v1/chat/completions",
                headers=auth,
                json={
                    "model": spec.model_id,
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                },
            )
            assert chat.status_code == 200, chat.text
            content = chat.json()["choices"][0]["message"]["content"]
            assert isinstance(content, str) and content.strip()

            assert (await client.get("/v1/models")).status_code == 401
            wrong = {"Authorization": "Bearer " + derive_engine_key(SECRET, "rep-other")}
            assert (await client.get("/v1/models", headers=wrong)).status_code == 401
            models = await client.get("/v1/models", headers=auth)
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == ["smol"]
    finally:
        exit_code = proc.stop()
    # SIGTERM is a clean shutdown, not a crash.
    assert exit_code == 0, proc.log_tail()


def run_entry_point(tmp_path: Path, argv: list[str], env: dict[str, str]) -> int:
    """Run the entry point to completion under ManagedProcess and return its exit code."""
    proc = ManagedProcess(
        "llamacpp-fail",
        [sys.executable, "-m", "agent.engines.llamacpp_main", *argv],
        tmp_path / "fail.log",
        env=env,
    )
    proc.start()
    try:
        assert proc.popen is not None
        return proc.popen.wait(60)
    finally:
        proc.stop()


def test_entry_point_without_key_exits_without_serving(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    port = free_port(HOST)
    argv = ["--model", "/nonexistent.gguf", "--host", HOST, "--port", str(port)]
    assert run_entry_point(tmp_path, argv, env) == EXIT_USAGE
    assert API_KEY_ENV in (tmp_path / "fail.log").read_text()


def test_entry_point_with_missing_model_fails(tmp_path: Path) -> None:
    env = {**os.environ, API_KEY_ENV: "mk-x"}
    port = free_port(HOST)
    argv = ["--model", str(tmp_path / "missing.gguf"), "--host", HOST, "--port", str(port)]
    assert run_entry_point(tmp_path, argv, env) != 0
