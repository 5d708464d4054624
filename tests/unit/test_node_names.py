"""Node names (AgentRegistration.name): a host name, as the agent's default (the machine's
host name) always is, and nothing a table, an event or a shell would mangle."""

from __future__ import annotations

import socket

import pytest
from pydantic import ValidationError

from modelkeeper.domain.ids import NodeId
from modelkeeper.domain.nodes import NODE_NAME_PATTERN, AgentRegistration, Inventory

pytestmark = pytest.mark.timeout(10)


def _register(name: str) -> AgentRegistration:
    return AgentRegistration(node_id=NodeId("n-1"), name=name, inventory=Inventory())


@pytest.mark.parametrize("name", [
    socket.gethostname(),  # the agent's default
    "gpu-box-1", "node_2", "ip-10-0-3-17.ec2.internal", "A", "7", "Mac-Pro.local",
    "x" * 64,  # Linux's HOST_NAME_MAX: every host name the kernel holds fits
])
def test_host_names_pass(name: str) -> None:
    assert _register(name).name == name


@pytest.mark.parametrize("name", [
    "", " box", "box ", "two words", "-flag", ".hidden", "x" * 65, "bell\x07", "new\nline",
    "tab\t", "esc\x1b[31m", "ünïcode", "semi;colon", "$(reboot)", "a/b",
])
def test_anything_else_is_refused_naming_the_field_value_and_pattern(name: str) -> None:
    with pytest.raises(ValidationError) as info:
        _register(name)
    [error] = info.value.errors()
    assert error["loc"] == ("name",) and error["input"] == name
    assert NODE_NAME_PATTERN in error["msg"]
