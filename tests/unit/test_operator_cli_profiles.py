"""The operator CLI and hardware profiles: ``models add --profiles FILE`` sends the file's
list, a bad file is a usage error naming it; ``ls`` shows the profiles replicas run and
``explain`` the profile it judged, with the ones it would pass over."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli import main as cli
from cli.main import build_parser
from cli.operator_cli import OPERATOR_COMMANDS, Request, render

pytestmark = pytest.mark.timeout(10)

PROFILES = [{"name": "gpu", "engine": "vllm", "gpus": 1, "priority": 1},
            {"name": "cpu", "engine": "llamacpp", "memory_bytes": 4 << 30}]


def parse(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def test_models_add_sends_the_profiles_file(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(PROFILES))
    args = parse("models", "add", "m", "--engine", "sim", "--source", "sim",
                 "--profiles", str(path))
    assert OPERATOR_COMMANDS["models"].request(args) == Request("POST", "/models", body={
        "model_id": "m", "engine": "sim", "source": "sim", "engine_args": {},
        "profiles": PROFILES})


@pytest.mark.parametrize(("content", "words"), [
    (None, ["cannot be read"]),
    ("{not json", ["not JSON"]),
    ('{"name": "cpu"}', ["a JSON list of profiles", "dict"]),
])
def test_a_bad_profiles_file_exits_2_naming_it(
        tmp_path: Path, content: str | None, words: list[str],
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profiles.json"
    if content is not None:
        path.write_text(content)
    code = cli.run(["models", "add", "m", "--engine", "sim", "--source", "sim",
                    "--profiles", str(path)])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"--profiles {path}" in line
    assert all(w in line for w in words), line


def test_ls_shows_the_profiles_its_replicas_run() -> None:
    deployment = {
        "deployment_id": "d1", "model_id": "m", "status": "serving", "ready_replicas": 2,
        "desired_replicas": 2, "consecutive_failures": 0, "placement_error": None,
        "last_failure": None, "workflow_id": "w1",
        "replicas": [{"replica_id": "r1", "state": "ready", "profile": "cpu"},
                     {"replica_id": "r2", "state": "ready", "profile": "gpu"},
                     {"replica_id": "r3", "state": "ready", "profile": "cpu"}]}
    [_, row] = render(parse("ls"), [deployment]).splitlines()
    assert row.endswith("profile cpu, gpu"), row
    # No profiles declared: nothing said.
    plain = {**deployment, "replicas": [{"replica_id": "r1", "state": "ready",
                                         "profile": None}]}
    assert "profile" not in render(parse("ls"), [plain])


def test_explain_names_the_profile_and_the_ones_passed_over() -> None:
    result = {"model_id": "m", "fits": True, "nodes_chosen": ["n1"], "summary": None,
              "profile": "cpu",
              "note": "runs profile cpu, passed over profile gpu: node a: 0 of 0 GPUs "
                      "free, needs 1",
              "nodes": [{"node_id": "n1", "name": "a", "fits": True, "message": "fits"}]}
    assert render(parse("explain", "m"), result).splitlines()[:2] == [
        "m: fits on a (profile cpu)",
        "runs profile cpu, passed over profile gpu: node a: 0 of 0 GPUs free, needs 1"]
