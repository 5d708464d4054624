"""`up`'s local stack keeps its secrets and state to itself (issue 19, the low findings):

* each child's environment holds only the secrets it reads, and none that `up` made: the
  cluster secret travels as a file, the database passwords as files a DSN names;
* path sources may not name the data dir's secrets or PostgreSQL's files by default, only
  ``<data_dir>/models`` (and the packaged models);
* what `up`, the Temporal dev server, the agent and its engines write is private;
* the operator can turn the gateway's client keys on under `up`.
"""

from __future__ import annotations

import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from agent.main import writable_agent_dir
from agent.shards import ShardManager
from cli import stack, temporal_server
from cli.main import build_parser, load_settings
from modelkeeper.domain.engine_keys import derive_node_key
from modelkeeper.domain.ids import ModelId, NodeId, ReplicaId
from modelkeeper.domain.shards import EngineKind, FetchProgress, ShardSpec
from modelkeeper.domain.sources import SourceRefused, check_path
from modelkeeper.infra.model_files import source_policy
from modelkeeper.infra.processes import ManagedProcess, free_port
from modelkeeper.settings import Settings

pytestmark = pytest.mark.timeout(60)

CHILDREN = ("worker", "api", "gateway", "agent", "temporal-ui", "temporal-front")


def _up_env(settings: Settings) -> dict[str, str]:
    """The components' environment `up` builds, with its engine key secret made."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    stack.ensure_secret_file(settings.engine_key_secret_file)
    url = stack.postgres.owner_dsn(stack.POSTGRES_HOST, settings.postgres_port,
                                   data_dir=settings.data_dir)
    return stack.component_env(settings, url)


def test_no_child_holds_the_cluster_secret_in_its_environment(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    env = _up_env(settings)
    secret = settings.engine_key_secret_file.read_text().strip()
    assert not [name for name, value in env.items() if secret in value]
    for child in CHILDREN:
        child_env = stack.env_for(child, env)
        assert not [name for name, value in child_env.items() if secret in value], child
        # A DSN names its role's password file, never a password.
        for name in ("MODELKEEPER_DATABASE_URL", "MODELKEEPER_GATEWAY_DATABASE_URL"):
            if name in child_env:
                assert urlsplit(child_env[name]).password is None, (child, name)


def test_each_child_gets_only_the_secrets_it_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's own variables, set in up's shell, are passed on to readers only.
    monkeypatch.setenv("MODELKEEPER_ENGINE_KEY_SECRET", "operator-secret")
    monkeypatch.setenv("MODELKEEPER_ENGINE_KEY_SECRET_PREVIOUS", "operator-previous")
    monkeypatch.setenv("MODELKEEPER_TOKEN", "mko-operator")
    env = _up_env(Settings(data_dir=tmp_path / "data"))
    has = {child: {name for name in stack.env_for(child, env)
                   if name in ("MODELKEEPER_ENGINE_KEY_SECRET",
                               "MODELKEEPER_ENGINE_KEY_SECRET_PREVIOUS", "MODELKEEPER_TOKEN",
                               "MODELKEEPER_DATABASE_URL", "MODELKEEPER_GATEWAY_DATABASE_URL")}
           for child in CHILDREN}
    assert has == {
        "worker": {"MODELKEEPER_DATABASE_URL"},
        "api": {"MODELKEEPER_DATABASE_URL", "MODELKEEPER_ENGINE_KEY_SECRET"},
        "gateway": {"MODELKEEPER_GATEWAY_DATABASE_URL", "MODELKEEPER_ENGINE_KEY_SECRET",
                    "MODELKEEPER_ENGINE_KEY_SECRET_PREVIOUS"},
        "agent": set(),
        # The Temporal UI's proxy checks logins against the operator tokens in the store.
        "temporal-ui": {"MODELKEEPER_DATABASE_URL"},
        "temporal-front": set(),
    }
    gateway_url = urlsplit(stack.env_for("gateway", env)["MODELKEEPER_GATEWAY_DATABASE_URL"])
    assert gateway_url.username == "modelkeeper_gateway"


def test_the_banner_names_the_password_file_not_the_password(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    _up_env(settings)
    text = stack.banner(settings)
    passfile = settings.data_dir / "secrets" / "modelkeeper.pgpass"
    line = next(line for line in text.splitlines() if "PostgreSQL" in line)
    assert f"postgresql://modelkeeper@127.0.0.1:{settings.postgres_port}/modelkeeper" in line
    assert str(passfile) in line


@pytest.mark.parametrize("under", ["secrets/m.gguf", "postgres/base/m.gguf",
                                   "engine_key_secret.gguf", "agent/weights/m.gguf"])
def test_default_roots_refuse_the_data_dir_s_own_files(tmp_path: Path, under: str) -> None:
    data_dir = tmp_path / "data"
    verdict = check_path(source_policy(Settings(data_dir=data_dir)), str(data_dir / under))
    assert isinstance(verdict, SourceRefused), verdict


def test_default_roots_allow_the_models_folder(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    verdict = check_path(source_policy(Settings(data_dir=data_dir)),
                         str(data_dir / "models" / "m.gguf"))
    assert not isinstance(verdict, SourceRefused), verdict


def _modes(root: Path) -> dict[str, int]:
    """Every file and folder under ``root`` (itself included) that has a group or other
    bit: what should be none."""
    paths = [root, *root.rglob("*")]
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in paths
            if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o077}


@pytest.fixture
def private() -> Iterator[None]:
    """The umask `up` and the agent run with (modelkeeper.infra.files)."""
    from modelkeeper.infra.files import private_files

    with private_files():
        yield


@pytest.fixture
def dev_server(tmp_path: Path, private: None) -> Iterator[ManagedProcess]:
    data_dir = tmp_path / "data"
    proc = temporal_server.start_dev_server(
        host="127.0.0.1", port=free_port(), http_port=free_port(),
        metrics_port=free_port(), ui=None,
        db_file=data_dir / "temporal" / "temporal.db", namespace="default",
        log_path=data_dir / "logs" / "temporal.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def manager(tmp_path: Path, private: None) -> AsyncIterator[ShardManager]:
    low = free_port()
    m = ShardManager(node_id=NodeId("n-private"), agent_dir=tmp_path / "data" / "agent",
                     engine_host="127.0.0.1", port_range=(low, low + 20),
                     node_key=derive_node_key(b"s", "n-private"))
    try:
        yield m
    finally:
        await m.close()
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("MODELKEEPER_NODE_ID") == "n-private":
                    proc.kill()
            except psutil.Error:
                continue


def _progress(_: FetchProgress) -> None:
    pass


async def test_what_up_s_components_write_is_private(
        tmp_path: Path, dev_server: ManagedProcess, manager: ShardManager) -> None:
    from modelkeeper.infra.files import make_private_dir

    data_dir = tmp_path / "data"
    # Data dirs an older up made: 0755, with a file in it.
    data_dir.chmod(0o755)
    settings = Settings(data_dir=data_dir)
    make_private_dir(data_dir)
    (settings.agent_dir).mkdir(mode=0o755, exist_ok=True)
    (settings.agent_dir).chmod(0o755)
    writable_agent_dir(settings)
    await manager.start(ShardSpec(
        replica_id=ReplicaId("r-private"), model_id=ModelId("sim"), node_id=NodeId("n-private"),
        engine=EngineKind.SIM, source="sim", memory_bytes=0, start_timeout_s=30.0),
        _progress)
    # Files that each writer made: Temporal's database and log, the shard record and the
    # engine's log.
    made = [data_dir / "temporal" / "temporal.db", data_dir / "logs" / "temporal.log",
            settings.agent_dir / "shards" / "r-private.json"]
    assert all(path.is_file() for path in made), made
    assert list((settings.agent_dir / "logs").iterdir()), "the engine writes a log"
    assert _modes(data_dir) == {}


def test_up_s_gateway_asks_for_keys_only_when_told(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    def up(*flags: str) -> Settings:
        return load_settings(build_parser().parse_args(
            ["up", "--data-dir", str(tmp_path), *flags]))

    def auth(settings: Settings) -> str:
        return stack.component_env(settings, "postgresql://x")["MODELKEEPER_GATEWAY_AUTH"]

    monkeypatch.delenv("MODELKEEPER_GATEWAY_AUTH", raising=False)
    off = up()
    assert auth(off) == "false"
    assert "AUTH OFF" in stack.banner(off) and "up --gateway-auth" in stack.banner(off)
    on = up("--gateway-auth")
    assert auth(on) == "true"
    gateway_line = next(line for line in stack.banner(on).splitlines() if "gateway " in line)
    assert "AUTH OFF" not in gateway_line
    assert "modelkeeper keys create NAME" in gateway_line
    # With keys on, the gateway's /metrics asks for a token: `up` makes one, private, and
    # hands the gateway its file (with keys off there is none, and /metrics stays open).
    assert stack.ensure_gateway_metrics_token(off) is None
    token_file = stack.ensure_gateway_metrics_token(on)
    assert token_file == tmp_path / stack.GATEWAY_METRICS_TOKEN_FILE
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(token_file.read_text().strip()) == 64
    assert stack.component_env(on, "postgresql://x", metrics_token_file=token_file)[
        "MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE"] == str(token_file)
    assert str(token_file) in gateway_line
    monkeypatch.setenv("MODELKEEPER_GATEWAY_AUTH", "true")
    assert auth(up()) == "true"
    monkeypatch.setenv("MODELKEEPER_GATEWAY_AUTH", "false")
    assert auth(up()) == "false"
