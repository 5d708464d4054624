"""docker-compose.temporal.yml and the Dockerfile, checked against the code.

Docker is not needed: the Compose file is loaded with PyYAML, its ``${VAR:-default}`` /
``${VAR:?message}`` references are interpolated the way Compose does, and every name, port,
image tag and search attribute is compared with what modelkeeper itself declares.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from modelkeeper.names import SEARCH_ATTRIBUTES
from modelkeeper.settings import Settings, env_var_names

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.temporal.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

MODELKEEPER_SERVICES = {
    "modelkeeper-api": "api",
    "modelkeeper-worker": "worker",
    "modelkeeper-gateway": "gateway",
}
EXPECTED_SERVICES = {
    "postgresql",
    "temporal",
    "temporal-admin-tools",
    "temporal-ui",
    "temporal-mtls",
    "temporal-create-search-attributes",
    *MODELKEEPER_SERVICES,
}
MODELKEEPER_SUBCOMMANDS = {"api", "worker", "gateway", "agent"}

#: Values for the variables the file requires (``${VAR:?...}``), as an operator would export.
OPERATOR_ENV = {
    "POSTGRES_PASSWORD": "pg-superuser-secret",
    "TEMPORAL_DB_PASSWORD": "temporal-secret",
    "MODELKEEPER_DB_PASSWORD": "modelkeeper-secret",
    "MODELKEEPER_GATEWAY_DB_PASSWORD": "gateway-secret",
}

#: What the operator writes into the env files the header tells them to create, one
#: secret per file; none of it is in the Compose file itself.
SECRET_FILES = {
    "secrets/join-token.env": {"MODELKEEPER_JOIN_TOKEN": "join-token-from-a-file"},
    "secrets/engine-key-secret.env": {"MODELKEEPER_ENGINE_KEY_SECRET": "engine-secret-from-a-file"},
}
SECRET_VARS = {var for values in SECRET_FILES.values() for var in values}
#: The processes that apply migrations, as the role that owns the schema. The gateway
#: connects as a role of its own, without DDL rights, and never migrates.
MIGRATING_SERVICES = {"modelkeeper-api", "modelkeeper-worker"}
GATEWAY_ROLE = "modelkeeper_gateway"

#: Port each third-party image listens on inside its container.
IMAGE_LISTEN_PORTS = {
    "postgres": 5432,
    "temporalio/auto-setup": 7233,
    "temporalio/ui": 8080,
    "nginx": 7233,
    "prom/prometheus": 9090,
    "grafana/grafana": 3000,
}
#: Services of Temporal's, and the profile each one that may publish a port needs: by
#: default nothing of Temporal's is reachable from outside Compose's network (issue 19).
TEMPORAL_SERVICES = {"temporal", "temporal-admin-tools", "temporal-ui", "temporal-mtls",
                     "temporal-create-search-attributes"}
PUBLISHING_PROFILES = {"temporal-ui": "ui", "temporal-mtls": "mtls"}

_DEFAULTS = {name: field.default for name, field in Settings.model_fields.items()}
ALLOWED_ENV = {env for name in Settings.model_fields for env in env_var_names(name)}

_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_]\w*)(?:(?P<modifier>:?[-?])(?P<arg>[^}]*))?\}")


def _interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable interpolation, for the forms this file may use."""
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, modifier, arg = match.group("name", "modifier", "arg")
        current = env.get(name)
        if modifier is None:
            if current is None:
                raise AssertionError(f"${{{name}}} has no default and is not set")
            return current
        unset = current is None or (modifier.startswith(":") and current == "")
        if modifier.endswith("-"):
            return arg if unset else str(current)
        if unset:
            raise AssertionError(f"required variable {name} unset: {arg}")
        return str(current)

    assert "$" not in _VAR.sub("", value), f"unsupported '$' use in {value!r}"
    return _VAR.sub(replace, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(raw, dict)
    result: dict[str, Any] = _interpolate(raw, OPERATOR_ENV)
    return result


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose["services"]
    return result


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    assert all(value is not None for value in env.values()), "env vars need explicit values"
    return {str(key): str(value) for key, value in env.items()}


def _env_files(service: Mapping[str, Any]) -> list[str]:
    entries = service.get("env_file") or []
    if isinstance(entries, str):
        entries = [entries]
    return [entry if isinstance(entry, str) else entry["path"] for entry in entries]


def _container_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """What the process sees: its env files' variables, then `environment` over them
    (Compose's order of precedence), with the files holding what SECRET_FILES says."""
    env: dict[str, str] = {}
    for path in _env_files(service):
        assert path in SECRET_FILES, f"unknown env file {path}"
        env.update(SECRET_FILES[path])
    env.update(_environment(service))
    return env


def _image_name_and_tag(image: str) -> tuple[str, str | None]:
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag at all (a ':' there belongs to a registry port)
        return image, None
    return name, tag


def _published(service: Mapping[str, Any]) -> dict[int, int]:
    """Container port -> host port, from the short "[IP:]HOST:CONTAINER" syntax."""
    return {container: host for container, (_, host) in _published_on(service).items()}


def _published_on(service: Mapping[str, Any]) -> dict[int, tuple[str, int]]:
    """Container port -> (host address, host port); "" for every address of the host."""
    result = {}
    for entry in service.get("ports", []):
        host, _, container = str(entry).rpartition(":")
        assert host, f"port {entry!r} should publish on an explicit host port"
        address, _, host_port = host.rpartition(":")
        result[int(container)] = (address, int(host_port))
    return result


def _depends_on(service: Mapping[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def _listen_port(services: Mapping[str, Any], name: str) -> int:
    """The port the service ``name`` listens on inside its container."""
    service = services[name]
    image_name, _ = _image_name_and_tag(service["image"])
    if image_name in IMAGE_LISTEN_PORTS:
        return IMAGE_LISTEN_PORTS[image_name]
    env = _environment(service)
    for field in ("api_port", "gateway_port"):
        for var in env_var_names(field):
            if var in env:
                return int(env[var])
    raise AssertionError(f"no known listening port for service {name}")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# --- Compose file ------------------------------------------------------------------------


def test_header_says_production_shape_and_points_dev_at_up() -> None:
    header = COMPOSE_FILE.read_text().split("\n\n", 1)[0]
    assert header.startswith("#")
    assert "production" in header
    assert "modelkeeper up" in header


def test_every_expected_service_exists(services: dict[str, Any]) -> None:
    assert set(services) >= EXPECTED_SERVICES, EXPECTED_SERVICES - set(services)


def test_shared_modelkeeper_env_is_an_extension(compose: dict[str, Any]) -> None:
    shared = compose["x-modelkeeper-env"]
    assert set(shared) <= ALLOWED_ENV
    for name in MODELKEEPER_SERVICES:
        env = _environment(compose["services"][name])
        assert {key: str(value) for key, value in shared.items()}.items() <= env.items(), name


def test_every_image_has_a_pinned_tag(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "image" not in service:
            continue
        _, tag = _image_name_and_tag(service["image"])
        assert tag is not None, f"{name}: image {service['image']!r} has no tag"
        assert tag != "latest", f"{name}: image must not float on :latest"
        # postgres's exact versions are MAJOR.MINOR (16.4); the rest use MAJOR.MINOR.PATCH,
        # Prometheus' with a v (v2.53.3).
        assert re.match(r"^v?\d+\.\d+(\.\d+)?(-[\w.-]+)?$", tag), f"{name}: {tag!r} floats"


def test_temporal_images_agree_on_the_server_version(services: dict[str, Any]) -> None:
    _, server = _image_name_and_tag(services["temporal"]["image"])
    assert server is not None
    major_minor = tuple(int(part) for part in server.split(".")[:2])
    assert (1, 20) <= major_minor < (1, 40), server
    for name, service in services.items():
        image_name, tag = _image_name_and_tag(service.get("image", ""))
        if image_name == "temporalio/admin-tools":
            assert tag is not None
            assert tag == server or tag.startswith(f"{server}-"), (name, tag, server)


def test_built_image_tag_is_the_package_version(services: dict[str, Any]) -> None:
    version = _pyproject()["project"]["version"]
    for name in MODELKEEPER_SERVICES:
        assert services[name]["image"] == f"modelkeeper:{version}", name


def test_modelkeeper_services_build_from_the_repo_dockerfile(services: dict[str, Any]) -> None:
    for name in MODELKEEPER_SERVICES:
        build = services[name]["build"]
        context = (COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == REPO, name
        assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE, name
        assert DOCKERFILE.is_file()


def test_modelkeeper_commands_are_subcommands(services: dict[str, Any]) -> None:
    for name, subcommand in MODELKEEPER_SERVICES.items():
        command = services[name]["command"]
        assert isinstance(command, list), f"{name}: use the exec (list) form"
        assert command[0] == "modelkeeper", name
        assert command[1] in MODELKEEPER_SUBCOMMANDS, name
        assert command == ["modelkeeper", subcommand], name


def test_modelkeeper_env_names_are_all_settings(services: dict[str, Any]) -> None:
    for name in MODELKEEPER_SERVICES:
        unknown = set(_environment(services[name])) - ALLOWED_ENV
        assert not unknown, f"{name}: Settings reads none of {sorted(unknown)}"


def _database_url(service: Mapping[str, Any]) -> str:
    """The DSN the service's process connects with (the gateway: its own role's)."""
    env = _environment(service)
    return env.get("MODELKEEPER_GATEWAY_DATABASE_URL") or env["MODELKEEPER_DATABASE_URL"]


def test_database_url_points_at_the_postgres_service(services: dict[str, Any]) -> None:
    for name in MODELKEEPER_SERVICES:
        url = urlsplit(_database_url(services[name]))
        assert url.scheme in {"postgresql", "postgres"}, name
        assert url.hostname in services, f"{name}: {url.hostname} is not a service"
        db_service = services[url.hostname]
        assert _image_name_and_tag(db_service["image"])[0] == "postgres"
        assert url.port == _listen_port(services, url.hostname) == 5432, name
        database = url.path.lstrip("/")
        # auto-setup owns these two; modelkeeper's tables live in a database of their own.
        assert database not in {"temporal", "temporal_visibility", ""}, name
        if name in MIGRATING_SERVICES:
            assert url.username == "modelkeeper"
            assert url.password == OPERATOR_ENV["MODELKEEPER_DB_PASSWORD"]
        else:
            assert url.username == GATEWAY_ROLE
            assert url.password == OPERATOR_ENV["MODELKEEPER_GATEWAY_DB_PASSWORD"]


def test_the_gateway_holds_no_dsn_of_the_schema_owner(services: dict[str, Any]) -> None:
    gateway = _container_environment(services["modelkeeper-gateway"])
    assert "MODELKEEPER_DATABASE_URL" not in gateway
    assert OPERATOR_ENV["MODELKEEPER_DB_PASSWORD"] not in " ".join(gateway.values())


def test_secrets_come_from_env_files_each_to_the_services_that_need_it(
    services: dict[str, Any],
) -> None:
    raw = COMPOSE_FILE.read_text()
    for values in SECRET_FILES.values():
        for value in values.values():
            assert value not in raw
    for name, service in services.items():
        written = set(_environment(service)) & SECRET_VARS
        assert not written, f"{name}: {sorted(written)} belong in an env file, not here"
    needs = {
        "modelkeeper-api": {"MODELKEEPER_JOIN_TOKEN", "MODELKEEPER_ENGINE_KEY_SECRET"},
        "modelkeeper-gateway": {"MODELKEEPER_ENGINE_KEY_SECRET"},
        "modelkeeper-worker": set(),
    }
    for name, wanted in needs.items():
        assert set(_container_environment(services[name])) & SECRET_VARS == wanted, name
    header = raw.split("\n\n", 1)[0]
    for path in SECRET_FILES:
        assert not Path(path).is_absolute() and path.startswith("secrets/"), path
        assert f"> {path}" in header, f"the header must say how to create {path}"


def test_the_gateway_starts_from_its_service_environment(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.server import engine_key_secret

    for var in ALLOWED_ENV:
        monkeypatch.delenv(var, raising=False)
    for key, value in _container_environment(services["modelkeeper-gateway"]).items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    # Each of these, missing, stopped the gateway at start (GatewayConfigError).
    assert engine_key_secret(settings) == b"engine-secret-from-a-file"
    assert settings.gateway_store_url == _database_url(services["modelkeeper-gateway"])
    assert not settings.gateway_migrates
    assert settings.gateway_auth, "a gateway reachable from the network requires client keys"
    assert settings.join_token is None


def test_postgres_init_creates_modelkeepers_role_and_database(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    postgresql = services["postgresql"]
    mounted = {entry["source"]: entry["target"] for entry in postgresql["configs"]}
    assert any(t.startswith("/docker-entrypoint-initdb.d/") for t in mounted.values())
    sql = "\n".join(compose["configs"][source]["content"] for source in mounted)
    url = urlsplit(_environment(services["modelkeeper-api"])["MODELKEEPER_DATABASE_URL"])
    assert re.search(rf"CREATE ROLE {url.username} LOGIN PASSWORD '{url.password}'", sql)
    assert re.search(rf"CREATE DATABASE {url.path.lstrip('/')} OWNER {url.username}\b", sql)
    # Not CREATEROLE: the schema's owner cannot make roles, so the gateway's is made here
    # and migration 0013 only grants it its tables.
    gateway = urlsplit(_database_url(services["modelkeeper-gateway"]))
    assert re.search(rf"CREATE ROLE {gateway.username} LOGIN PASSWORD '{gateway.password}';",
                     sql)
    temporal = _environment(services["temporal"])
    assert re.search(
        rf"CREATE ROLE {temporal['POSTGRES_USER']} LOGIN CREATEDB "
        rf"PASSWORD '{temporal['POSTGRES_PWD']}'",
        sql,
    )


def test_postgres_has_a_pg_isready_healthcheck_and_a_named_volume(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    postgresql = services["postgresql"]
    env = _environment(postgresql)
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD"} <= set(env)
    assert "pg_isready" in postgresql["healthcheck"]["test"]
    volume_names = {str(v).split(":", 1)[0] for v in postgresql["volumes"]}
    assert volume_names & set(compose["volumes"]), "PGDATA should be on a named volume"


def test_temporal_uses_the_postgres_service(services: dict[str, Any]) -> None:
    temporal = services["temporal"]
    assert _image_name_and_tag(temporal["image"])[0] == "temporalio/auto-setup"
    env = _environment(temporal)
    assert env["DB"] == "postgres12"
    assert env["POSTGRES_SEEDS"] in services
    assert int(env["DB_PORT"]) == _listen_port(services, env["POSTGRES_SEEDS"])
    assert {"POSTGRES_USER", "POSTGRES_PWD"} <= set(env)
    assert _depends_on(temporal) == {"postgresql": "service_healthy"}


def test_temporal_address_points_at_the_temporal_service(services: dict[str, Any]) -> None:
    clients = [*MODELKEEPER_SERVICES, "temporal-ui", "temporal-admin-tools"]
    clients.append("temporal-create-search-attributes")
    for name in clients:
        host, _, port = _environment(services[name])["TEMPORAL_ADDRESS"].rpartition(":")
        assert host in services, f"{name}: {host} is not a service"
        assert _image_name_and_tag(services[host]["image"])[0] == "temporalio/auto-setup"
        assert int(port) == _listen_port(services, host) == 7233, name


def test_every_client_uses_the_namespace_auto_setup_creates(services: dict[str, Any]) -> None:
    namespace = _environment(services["temporal"])["DEFAULT_NAMESPACE"]
    for name in MODELKEEPER_SERVICES:
        assert _environment(services[name])["TEMPORAL_NAMESPACE"] == namespace, name
    script = "\n".join(services["temporal-create-search-attributes"]["command"])
    assert set(re.findall(r"--namespace\s+(\S+)", script)) == {namespace}


def test_published_ports_match_settings_defaults(services: dict[str, Any]) -> None:
    assert _published(services["modelkeeper-api"]) == {_DEFAULTS["api_port"]: _DEFAULTS["api_port"]}
    assert _published(services["modelkeeper-gateway"]) == {
        _DEFAULTS["gateway_port"]: _DEFAULTS["gateway_port"]
    }
    assert _published(services["temporal"]) == {}, "Temporal's frontend has no TLS of its own"
    assert _published_on(services["temporal-ui"]) == {
        8080: ("127.0.0.1", _DEFAULTS["temporal_ui_port"])}
    assert _published(services["temporal-mtls"]) == {7233: _DEFAULTS["temporal_port"]}
    assert _published(services["modelkeeper-worker"]) == {}
    assert _published(services["postgresql"]) == {}, "keep PostgreSQL off the host"
    # Each published container port is the one the process inside listens on.
    for name in ("modelkeeper-api", "modelkeeper-gateway"):
        assert set(_published(services[name])) == {_listen_port(services, name)}


def test_depends_on_targets_exist_with_valid_conditions(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for target, condition in _depends_on(service).items():
            assert target in services, f"{name} depends on unknown {target}"
            assert target != name
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[target].get("restart", "no") == "no", target
            else:
                assert condition == "service_started", (name, target, condition)
    for name in MODELKEEPER_SERVICES:
        deps = _depends_on(services[name])
        assert deps["postgresql"] == "service_healthy", name
        if name in MIGRATING_SERVICES:
            assert "temporal" in deps, name
            assert deps["temporal-create-search-attributes"] == "service_completed_successfully"
        else:
            # It may not migrate: it waits for the API, which migrates before it is healthy.
            assert deps["modelkeeper-api"] == "service_healthy", name


def test_search_attribute_service_creates_exactly_the_codes_attributes(
    services: dict[str, Any],
) -> None:
    service = services["temporal-create-search-attributes"]
    assert _image_name_and_tag(service["image"])[0] == "temporalio/admin-tools"
    # admin-tools' own entrypoint is `sleep infinity`; the script must replace it.
    assert service["entrypoint"][0] in {"/bin/sh", "/bin/bash", "sh", "bash"}
    script = "\n".join(service["command"])
    created = dict(
        re.findall(r"search-attribute create\b.*?--name\s+(\S+)\s+--type\s+(\S+)", script)
    )
    assert created == SEARCH_ATTRIBUTES
    assert "temporal" in _depends_on(service)


def test_admin_tools_and_ui(services: dict[str, Any]) -> None:
    tools = services["temporal-admin-tools"]
    assert _image_name_and_tag(tools["image"])[0] == "temporalio/admin-tools"
    assert tools["stdin_open"] is True
    assert tools["tty"] is True
    assert _image_name_and_tag(services["temporal-ui"]["image"])[0] == "temporalio/ui"


@pytest.mark.parametrize(("service_name", "subcommand"), sorted(MODELKEEPER_SERVICES.items()))
def test_settings_load_from_each_service_environment(
    services: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    service_name: str,
    subcommand: str,
) -> None:
    for var in ALLOWED_ENV:
        monkeypatch.delenv(var, raising=False)
    env = _container_environment(services[service_name])
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    settings = Settings()

    if subcommand == "gateway":
        assert settings.gateway_store_url == env["MODELKEEPER_GATEWAY_DATABASE_URL"]
    else:
        assert settings.database_url == env["MODELKEEPER_DATABASE_URL"]
    assert settings.temporal_address == "temporal:7233"
    assert settings.temporal_namespace == "default"
    assert settings.bind_host == "0.0.0.0"
    assert settings.log_level == "INFO"
    assert settings.api_port == _DEFAULTS["api_port"]
    assert settings.gateway_port == _DEFAULTS["gateway_port"]
    if subcommand == "api":
        assert "MODELKEEPER_API_PORT" in env
    if subcommand == "gateway":
        assert "MODELKEEPER_GATEWAY_PORT" in env


def test_interpolation_requires_the_operator_passwords() -> None:
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    for var in OPERATOR_ENV:
        partial = {key: value for key, value in OPERATOR_ENV.items() if key != var}
        with pytest.raises(AssertionError, match=var):
            _interpolate(raw, partial)


# --- Dockerfile ----------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    result = []
    for entry in logical:
        instruction, _, args = entry.partition(" ")
        result.append((instruction.upper(), args.strip()))
    return result


def _copy_sources() -> list[str]:
    sources = []
    for instruction, args in _dockerfile_instructions():
        if instruction in {"COPY", "ADD"}:
            words = shlex.split(args)
            assert not any(w.startswith("--from") for w in words), "single-stage build expected"
            sources.extend([w for w in words if not w.startswith("--")][:-1])
    return sources


def test_dockerfile_from_is_pinned() -> None:
    froms = [args for instruction, args in _dockerfile_instructions() if instruction == "FROM"]
    assert froms
    for image in froms:
        name, tag = _image_name_and_tag(image.split()[0])
        assert name == "python"
        assert tag is not None
        match = re.match(r"^(\d+)\.(\d+)\.(\d+)-slim", tag)
        assert match, f"FROM {image!r} must pin an exact Python version, slim variant"
        assert (int(match[1]), int(match[2])) == (3, 11)


def test_dockerfile_copies_existing_files() -> None:
    sources = _copy_sources()
    assert {"pyproject.toml", "README.md", "constraints.txt"} <= set(sources)
    missing = [source for source in sources if not (REPO / source).exists()]
    assert not missing, f"Dockerfile copies paths that do not exist: {missing}"


def test_dockerfile_copies_every_package_pyproject_installs() -> None:
    includes = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {source.rstrip("/") for source in _copy_sources()}
    for pattern in includes:
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied"


def test_dockerfile_installs_with_the_constraints_file() -> None:
    runs = [args for instruction, args in _dockerfile_instructions() if instruction == "RUN"]
    installs = [run for run in runs if "pip install" in run]
    assert installs
    for run in installs:
        words = shlex.split(run)
        assert "--no-cache-dir" in words
        flag = "-c" if "-c" in words else "--constraint"
        assert flag in words, f"pip install without the constraints file: {run!r}"
        assert words[words.index(flag) + 1] == "constraints.txt"
    assert "constraints.txt" in _copy_sources()


def test_dockerfile_runs_modelkeeper_api_as_non_root() -> None:
    instructions = _dockerfile_instructions()
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users
    assert users[-1].split(":")[0] not in {"root", "0"}
    exposed = {
        int(port.split("/")[0])
        for instruction, args in instructions
        if instruction == "EXPOSE"
        for port in args.split()
    }
    assert exposed >= {_DEFAULTS["api_port"], _DEFAULTS["gateway_port"]}
    # Compose overrides `command` with the full argv, which only works with no ENTRYPOINT.
    assert not [args for instruction, args in instructions if instruction == "ENTRYPOINT"]
    cmds = [args for instruction, args in instructions if instruction == "CMD"]
    assert json.loads(cmds[-1]) == ["modelkeeper", "api"]


def test_dockerignore_keeps_the_build_context_small_but_complete() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git"} <= set(patterns)
    assert any("cache" in pattern for pattern in patterns)
    for source in _copy_sources():
        excluded = [p for p in patterns if not p.startswith("!") and fnmatch.fnmatch(source, p)]
        assert not excluded, f"{source} is copied but .dockerignore excludes it ({excluded})"


def test_nothing_of_temporals_is_published_by_default(services: dict[str, Any]) -> None:
    """Issue 19: 7233 and 8233 were published, in plaintext, with no authorizer."""
    assert set(services) >= TEMPORAL_SERVICES
    for name in TEMPORAL_SERVICES:
        service = services[name]
        if not service.get("ports"):
            continue
        assert service.get("profiles") == [PUBLISHING_PROFILES[name]], (
            f"{name} publishes {service['ports']} without an opt-in profile")
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert not any(_published(services[name]) for name in default & TEMPORAL_SERVICES)
    # What the default publishes at all: the API and the gateway.
    assert {name for name in default if services[name].get("ports")} == {
        "modelkeeper-api", "modelkeeper-gateway"}


def test_the_mtls_profile_requires_a_client_certificate(
        compose: dict[str, Any], services: dict[str, Any]) -> None:
    front = services["temporal-mtls"]
    mounted = {entry["source"]: entry["target"] for entry in front["configs"]}
    assert mounted == {"temporal-mtls-nginx": "/etc/nginx/nginx.conf"}
    conf = compose["configs"]["temporal-mtls-nginx"]["content"]
    directives = {line.strip().rstrip(";") for line in conf.splitlines()}
    assert "ssl_verify_client on" in directives
    assert f"listen {_listen_port(services, 'temporal-mtls')} ssl" in directives
    assert "ssl_alpn h2" in directives, "gRPC clients negotiate HTTP/2 by ALPN"
    assert f"proxy_pass temporal:{_listen_port(services, 'temporal')}" in directives
    files = {line.split()[1] for line in directives
             if line.startswith(("ssl_certificate", "ssl_client_certificate"))}
    volume = next(v for v in front["volumes"] if v.endswith(":ro"))
    source, target, _ = volume.split(":")
    assert source.startswith("./secrets/"), "keys stay in secrets/, out of version control"
    assert files == {f"{target}/server.pem", f"{target}/server.key", f"{target}/ca.pem"}


# --- the monitoring profile ----------------------------------------------------------------

MONITORING = {"prometheus": "prom/prometheus", "grafana": "grafana/grafana"}
PROMETHEUS_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"


def _mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """Container path -> host path (relative as written) of each bind mount."""
    result = {}
    for entry in service.get("volumes", []):
        source, target, *_ = str(entry).split(":")
        if source.startswith("./"):
            result[target] = source
    return result


def _host_path_of(service: Mapping[str, Any], container_path: str) -> str:
    """The host path behind ``container_path``, through the mount that holds it."""
    for target, source in sorted(_mounts(service).items(), key=lambda m: -len(m[0])):
        if container_path == target or container_path.startswith(target + "/"):
            return source + container_path[len(target):]
    raise AssertionError(f"{container_path} is on no bind mount")


def test_monitoring_runs_only_in_its_profile_and_on_loopback(
        services: dict[str, Any]) -> None:
    for name, image in MONITORING.items():
        service = services[name]
        assert service["profiles"] == ["monitoring"], name
        assert _image_name_and_tag(service["image"])[0] == image
        # Prometheus has no login, Grafana one password: the Docker host's loopback only.
        assert _published_on(service) == {
            _listen_port(services, name): ("127.0.0.1", _listen_port(services, name))}


def test_prometheus_loads_the_shipped_config_and_rules(services: dict[str, Any]) -> None:
    prometheus = services["prometheus"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in prometheus["command"])
    config = _host_path_of(prometheus, flags["config.file"])
    assert (REPO / config).resolve() == PROMETHEUS_CONFIG
    for rule_file in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / rule_file).is_file(), rule_file


def test_prometheus_scrapes_the_api_and_the_gateway_by_names_they_answer(
        services: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for job_name, service_name, hosts_field in (
            ("modelkeeper-api", "modelkeeper-api", "api_allowed_hosts"),
            ("modelkeeper-gateway", "modelkeeper-gateway", "gateway_allowed_hosts")):
        [target] = jobs[job_name]["static_configs"][0]["targets"]
        host, _, port = target.rpartition(":")
        assert host == service_name and int(port) == _listen_port(services, service_name)
        # The Host header is the target's name: the process must allow it, or it is a 400.
        env = _environment(services[service_name])
        [var] = [v for v in env_var_names(hosts_field) if v in env]
        assert host in env[var].split(","), f"{service_name} does not answer Host {host}"
        assert jobs[job_name]["authorization"]["type"] == "Bearer"


def test_prometheus_sends_the_gateway_the_token_it_reads(services: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    files = {job["job_name"]: job["authorization"]["credentials_file"]
             for job in config["scrape_configs"]}
    prometheus, gateway = services["prometheus"], services["modelkeeper-gateway"]
    sent = _host_path_of(prometheus, files["modelkeeper-gateway"])
    read = _environment(gateway)["MODELKEEPER_GATEWAY_METRICS_TOKEN_FILE"]
    assert _host_path_of(gateway, read) == sent
    for path in files.values():
        host = _host_path_of(prometheus, path)
        assert host.startswith("./secrets/monitoring/"), "tokens stay out of the repository"
        assert f"> {host.removeprefix('./')}" in COMPOSE_FILE.read_text(), \
            f"the header must say how to make {host}"


def test_grafana_is_provisioned_and_its_password_comes_from_a_file(
        services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    env = _environment(grafana)
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    password = _host_path_of(grafana, env["GF_SECURITY_ADMIN_PASSWORD__FILE"])
    assert password.startswith("./secrets/monitoring/")
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for source in _mounts(grafana).values():
        if not source.startswith("./secrets/"):
            assert (REPO / source).exists(), source
