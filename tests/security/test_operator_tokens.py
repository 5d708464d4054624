"""Operator tokens from the operator's side: `modelkeeper tokens` straight in the database,
the token the CLI presents (MODELKEEPER_TOKEN, a file, `up`'s file), and the admin token
`up` makes on first start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cli import main as cli
from cli.operator_cli import UsageError, operator_token, run_operator_command
from cli.stack import LOCAL_ADMIN, ensure_operator_token, local_operator_name
from modelkeeper.domain.operators import OperatorRole
from modelkeeper.settings import Settings
from modelkeeper.store import Store

pytestmark = pytest.mark.timeout(60)


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``modelkeeper ARGV`` in process (in a thread: it runs its own event loop)."""
    code = await asyncio.to_thread(cli.run, list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out, captured.err


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str) -> Path:
    """The CLI's environment: the test database, and a data dir of its own."""
    for name in ("MODELKEEPER_TOKEN", "MODELKEEPER_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODELKEEPER_DATABASE_URL", database_url)
    monkeypatch.setenv("MODELKEEPER_DATA_DIR", str(tmp_path))
    return tmp_path


async def test_tokens_are_created_listed_and_revoked_from_the_cli(
        cli_env: Path, capsys: pytest.CaptureFixture[str], store: Store) -> None:
    code, out, _ = await run_cli(capsys, "tokens", "create", "ci-bot", "--role", "viewer")
    assert code == 0
    token, note = out.splitlines()
    assert token.startswith("mko-") and len(token) == 4 + 43
    assert "shown this once" in note and "viewer" in note
    record = await store.tokens.authenticate(token)
    assert record is not None and (record.name, record.role) == ("ci-bot", OperatorRole.VIEWER)

    code, out, _ = await run_cli(capsys, "tokens", "ls")
    assert code == 0 and token not in out, "ls must never show a token"
    assert record.token_id in out and token[:12] in out and "viewer" in out

    code, out, _ = await run_cli(capsys, "tokens", "revoke", token[:12])
    assert code == 0 and out.strip() == (
        f"revoked {record.token_id} (ci-bot, viewer, {token[:12]}…)")
    assert await store.tokens.authenticate(token) is None

    code, out, err = await run_cli(capsys, "tokens", "revoke", token[:12])
    assert code == 2 and out == ""
    assert err.strip() == (f"modelkeeper tokens: tokens revoke {token[:12]!r}: no active token "
                           "has that id or prefix (modelkeeper tokens ls lists them)")


@pytest.mark.parametrize(("argv", "words"), [
    (["tokens", "create", "two words", "--role", "admin"], ["'two words'", "1 to 64"]),
    (["tokens", "create", "x" * 65, "--role", "admin"], ["1 to 64", "65 characters"]),
])
async def test_a_bad_token_name_exits_2_with_one_sentence(
        cli_env: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        words: list[str], store: Store) -> None:
    code, _, err = await run_cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert await store.tokens.list_tokens() == []


def test_a_role_must_be_given_and_known(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["tokens", "create", "x"], ["tokens", "create", "x", "--role", "root"]):
        with pytest.raises(SystemExit) as info:
            cli.run(argv)
        assert info.value.code == 2
        assert "--role" in capsys.readouterr().err


def test_the_cli_presents_the_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    assert operator_token(Settings(data_dir=tmp_path)) is None
    (tmp_path / "operator-token").write_text("mko-from-up\n")
    assert operator_token(Settings(data_dir=tmp_path)) == "mko-from-up"
    named = tmp_path / "mine"
    named.write_text("  mko-named \n")
    assert operator_token(Settings(data_dir=tmp_path, token_file=named)) == "mko-named"
    assert operator_token(Settings(data_dir=tmp_path, token_file=named,
                                   token="mko-env")) == "mko-env"
    for content, words in ((None, "no such file"), ("\n", "is empty")):
        missing = tmp_path / "other"
        if content is not None:
            missing.write_text(content)
        with pytest.raises(UsageError) as info:
            operator_token(Settings(data_dir=tmp_path, token_file=missing))
        assert "token_file (MODELKEEPER_TOKEN_FILE)" in str(info.value)
        assert repr(str(missing)) in str(info.value) and words in str(info.value)


async def test_operator_commands_send_the_token(
        cli_env: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json=[])

    monkeypatch.setattr(cli, "run_operator_command", lambda *a, **kw: run_operator_command(
        *a, **kw, transport=httpx.MockTransport(handler)))
    assert (await run_cli(capsys, "ls"))[0] == 0
    (cli_env / "operator-token").write_text("mko-local\n")
    assert (await run_cli(capsys, "ls", "--json"))[0] == 0
    monkeypatch.setenv("MODELKEEPER_TOKEN", "mko-env")
    assert (await run_cli(capsys, "nodes"))[0] == 0
    assert seen == [None, "Bearer mko-local", "Bearer mko-env"]


async def test_a_401_from_the_api_exits_2_saying_what_is_needed(
        cli_env: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    detail = "GET /deployments needs an operator token, and none was sent; send one"
    monkeypatch.setattr(cli, "run_operator_command", lambda *a, **kw: run_operator_command(
        *a, **kw, transport=httpx.MockTransport(
            lambda _: httpx.Response(401, json={"detail": detail}))))
    code, _, err = await run_cli(capsys, "ls")
    assert code == 2 and err.strip() == f"modelkeeper ls: 401 {detail}"


async def test_up_makes_an_admin_token_once_and_again_when_revoked(
        database_url: str, tmp_path: Path, store: Store) -> None:
    path = tmp_path / "operator-token"
    first = await ensure_operator_token(database_url, path, "alice")
    assert path.read_text() == first + "\n" and path.stat().st_mode & 0o777 == 0o600
    record = await store.tokens.authenticate(first)
    assert record is not None and (record.name, record.role) == ("alice", OperatorRole.ADMIN)
    # A restart keeps it.
    assert await ensure_operator_token(database_url, path, "alice") == first
    assert len(await store.tokens.list_tokens()) == 1
    # Revoked (or replaced by a viewer's): `up` needs an admin token, so it makes one.
    await store.tokens.revoke_tokens(record.token_id)
    second = await ensure_operator_token(database_url, path, "alice")
    assert second != first and path.read_text() == second + "\n"
    assert path.stat().st_mode & 0o777 == 0o600
    _, viewer = await store.tokens.create_token("v", OperatorRole.VIEWER)
    path.write_text(viewer)
    assert await ensure_operator_token(database_url, path, "alice") not in (viewer, second)


def test_ups_token_is_named_after_the_local_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("getpass.getuser", lambda: "alice")
    assert local_operator_name() == "alice"
    monkeypatch.setattr("getpass.getuser", lambda: "not a name")
    assert local_operator_name() == LOCAL_ADMIN

    def no_user() -> str:
        raise KeyError("uid 1234")

    monkeypatch.setattr("getpass.getuser", no_user)
    assert local_operator_name() == LOCAL_ADMIN
