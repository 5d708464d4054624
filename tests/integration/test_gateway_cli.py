"""`modelkeeper keys` and `modelkeeper gateway` as a user runs them: real processes,
several gateway workers sharing one port, the openai SDK against them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest

from modelkeeper.infra.processes import ManagedProcess, free_port
from tests.support.gateway_support import HOST, SECRET, add_deployment, add_replica, metric, sims

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

MODEL = "sim-cli"


def cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "modelkeeper", *args], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "MODELKEEPER_DATABASE_URL": database_url})


def start_gateway(tmp_path: Path, database_url: str, port: int, *flags: str,
                  metrics_token_file: Path | None = None) -> ManagedProcess:
    env = {**os.environ, "MODELKEEPER_DATABASE_URL": database_url,
           "MODELKEEPER_ENGINE_KEY_SECRET": SECRET.decode(), "MODELKEEPER_BIND_HOST": HOST}
    if metrics_token_file is not None:
        env["MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE"] = str(metrics_token_file)
    process = ManagedProcess("gateway", [sys.executable, "-m", "modelkeeper", "gateway",
                                         "--gateway-port", str(port), *flags],
                             tmp_path / "gateway.log", env=env)
    process.start()

    def healthy() -> bool:
        try:
            return httpx.get(f"http://{HOST}:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        process.wait_until(healthy, timeout=60)
    except BaseException:
        process.stop()
        raise
    return process


async def test_keys_cli_and_a_multi_worker_gateway(tmp_path: Path, database_url: str) -> None:
    created = cli(database_url, "keys", "create", "ci-bot")
    assert created.returncode == 0, created.stderr
    key = created.stdout.splitlines()[0]
    assert key.startswith("mkc-")
    listed = cli(database_url, "keys", "ls")
    assert "ci-bot" in listed.stdout and key[:12] in listed.stdout
    assert key not in listed.stdout, "ls must never show a key"

    conn = await asyncpg.connect(database_url)
    try:
        deployment = await add_deployment(conn, MODEL)
        async with sims(tmp_path, MODEL, "r-cli") as (sim,):
            await add_replica(conn, deployment, "r-cli", sim.url)
            port = free_port()
            # With client auth on, /metrics needs the scraper's token (every worker reads it).
            token_file = tmp_path / "metrics-token"
            token_file.write_text("scrape-me\n")
            gateway = start_gateway(tmp_path, database_url, port, "--workers", "2",
                                    metrics_token_file=token_file)
            try:
                base = f"http://{HOST}:{port}"
                # Separate clients, separate connections: SO_REUSEPORT spreads them over
                # both workers.
                for _ in range(6):
                    with openai.OpenAI(base_url=base + "/v1", api_key=key,
                                       max_retries=0) as client:
                        chat = client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "hi"}],
                            max_tokens=2)
                        assert chat.choices[0].message.content == "the quick"
                with openai.OpenAI(base_url=base + "/v1", api_key=key,
                                   max_retries=0) as client:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=3, stream=True)
                    text = "".join(c.choices[0].delta.content or "" for c in stream
                                   if c.choices)
                    assert text == "the quick brown"
                    with pytest.raises(openai.AuthenticationError):
                        openai.OpenAI(base_url=base + "/v1", api_key="mkc-wrong",
                                      max_retries=0).models.list()

                # Any worker's /metrics counts every worker's requests.
                assert httpx.get(base + "/metrics").status_code == 401
                scraped = httpx.get(base + "/metrics",
                                    headers={"Authorization": "Bearer scrape-me"}).text
                assert metric(scraped, "modelkeeper_gateway_requests_total", model=MODEL,
                              code="200") == 7

                revoked = cli(database_url, "keys", "revoke", key[:12])
                assert revoked.returncode == 0 and "revoked" in revoked.stdout
                assert cli(database_url, "keys", "revoke", key[:12]).returncode == 1
            finally:
                assert gateway.stop() == 0, gateway.log_tail()
            log = (tmp_path / "gateway.log").read_text()
            assert "AUTHENTICATION IS OFF" not in log
    finally:
        await conn.close()


async def test_gateway_without_auth_says_so_loudly(tmp_path: Path, database_url: str) -> None:
    port = free_port()
    gateway = start_gateway(tmp_path, database_url, port, "--no-auth")
    try:
        resp = httpx.get(f"http://{HOST}:{port}/v1/models")
        assert resp.status_code == 200 and resp.json() == {"object": "list", "data": []}
    finally:
        gateway.stop()
    assert "CLIENT AUTHENTICATION IS OFF" in (tmp_path / "gateway.log").read_text()


def test_gateway_refuses_to_start_without_the_engine_key_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELKEEPER_")}
    env.update(MODELKEEPER_DATABASE_URL="postgresql://nowhere/none",
               MODELKEEPER_DATA_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-m", "modelkeeper", "gateway"],
                            capture_output=True, text=True, timeout=60, env=env, check=False)
    assert result.returncode == 2
    assert "MODELKEEPER_ENGINE_KEY_SECRET" in result.stderr
