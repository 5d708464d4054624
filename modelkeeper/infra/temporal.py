"""Connecting to Temporal the same way from every component."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, overload

from temporalio.client import Client, Interceptor, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, TLSConfig
from temporalio.workflow import UpdateMethodMultiParam

from ..domain.ids import DeploymentId
from ..names import SIGNAL_NODES_CHANGED, deployment_workflow_id
from ..settings import Settings, env_var_names
from . import tracing

_W = TypeVar("_W")
_A = TypeVar("_A")
_R = TypeVar("_R")

#: What a PEM file starts with. Checked at start so that a DER file, or a key where the
#: certificate belongs, is named here rather than failing as a bare handshake error later.
PEM_MARKER = b"-----BEGIN "


class TemporalConfigError(Exception):
    """A Temporal TLS or API key setting this process cannot use; reported as one line."""


@dataclass(frozen=True)
class TemporalSecurity:
    """How a client checks the Temporal server and proves who it is: TLS (with a client
    certificate for mTLS) and an API key. Plaintext when both are None (the dev server
    of `modelkeeper up`, on loopback).

    Built once per process from its own settings by :func:`security_from_settings` and
    handed to :func:`connect`. Never sent anywhere else: an agent's comes from its own
    machine, not from the API. Neither field is in the repr, so logging one leaks no
    private key or API key.
    """

    tls: TLSConfig | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """For logs: what is on, never what it holds (``mTLS, API key``; ``plaintext``)."""
        if self.tls is None:
            return "plaintext"
        parts = ["mTLS" if self.tls.client_cert is not None else "TLS"]
        if self.api_key is not None:
            parts.append("API key")
        return ", ".join(parts)


#: No TLS, no key: the loopback dev server of `modelkeeper up` and the tests' servers.
PLAINTEXT = TemporalSecurity()


def _setting(name: str) -> str:
    """How an operator sets the field ``name``: its environment variable."""
    return env_var_names(name)[0]


def _read_secret_file(path: Path, *, name: str, must_be: str) -> bytes:
    """The bytes of the file the setting ``name`` points to, or a sentence saying what is
    wrong with it: the setting, the path and what the file must be."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise TemporalConfigError(
            f"{_setting(name)} is {str(path)!r}, which does not exist; it must be "
            f"{must_be}") from err
    except OSError as err:
        raise TemporalConfigError(
            f"{_setting(name)} is {str(path)!r}, which cannot be read ({err.strerror}); it "
            f"must be {must_be}, readable by this process") from err
    if not data.strip():
        raise TemporalConfigError(
            f"{_setting(name)} is {str(path)!r}, which is empty; it must be {must_be}")
    return data


def _read_pem(path: Path, *, name: str, must_be: str) -> bytes:
    data = _read_secret_file(path, name=name, must_be=must_be)
    if PEM_MARKER not in data:
        raise TemporalConfigError(
            f"{_setting(name)} is {str(path)!r}, which is not PEM (no '-----BEGIN' line); "
            f"it must be {must_be}")
    return data


def security_from_settings(settings: Settings) -> TemporalSecurity:
    """The TLS and API key this process connects to Temporal with, from its settings.

    Reads the files once, at start, so a missing or unreadable one is reported as a
    :class:`TemporalConfigError` naming the setting, the path and what the file must be,
    before any connection is tried. TLS is on when ``temporal_tls`` or any other TLS
    setting is set, and always with an API key, which must never cross the network in
    the clear.
    """
    ca = cert = key = None
    if settings.temporal_tls_ca_file is not None:
        ca = _read_pem(settings.temporal_tls_ca_file, name="temporal_tls_ca_file",
                       must_be="a PEM file of the CA certificates that signed the Temporal "
                       "server's certificate")
    if (settings.temporal_tls_cert_file is None) != (settings.temporal_tls_key_file is None):
        given, missing = (("temporal_tls_cert_file", "temporal_tls_key_file")
                          if settings.temporal_tls_key_file is None
                          else ("temporal_tls_key_file", "temporal_tls_cert_file"))
        raise TemporalConfigError(
            f"{_setting(given)} is set but {_setting(missing)} is not; mTLS needs both the "
            "client certificate and its private key")
    if settings.temporal_tls_cert_file is not None:
        cert = _read_pem(settings.temporal_tls_cert_file, name="temporal_tls_cert_file",
                         must_be="a PEM file of this process's client certificate")
    if settings.temporal_tls_key_file is not None:
        key = _read_pem(settings.temporal_tls_key_file, name="temporal_tls_key_file",
                        must_be="a PEM file of the private key of "
                        f"{_setting('temporal_tls_cert_file')}")
    api_key = None
    if settings.temporal_api_key_file is not None:
        raw = _read_secret_file(settings.temporal_api_key_file, name="temporal_api_key_file",
                                must_be="a file holding the Temporal API key")
        try:
            api_key = raw.decode("utf-8").strip()
        except UnicodeDecodeError as err:
            raise TemporalConfigError(
                f"{_setting('temporal_api_key_file')} is "
                f"{str(settings.temporal_api_key_file)!r}, which is not UTF-8 text; it must "
                "be a file holding the Temporal API key") from err
    tls_on = (settings.temporal_tls or api_key is not None
              or settings.temporal_tls_server_name is not None
              or any(part is not None for part in (ca, cert, key)))
    if not tls_on:
        return PLAINTEXT
    tls = TLSConfig(server_root_ca_cert=ca, domain=settings.temporal_tls_server_name,
                    client_cert=cert, client_private_key=key)
    return TemporalSecurity(tls=tls, api_key=api_key)


async def connect(address: str, namespace: str, *, security: TemporalSecurity,
                  wait: float = 0.0) -> Client:
    """A client for ``address`` and ``namespace``, using the pydantic converter.

    Every component connects through here (the agent with the address the API hands it),
    so none can forget the converter and send payloads the others cannot read.

    ``security`` is the process's own TLS and API key (:func:`security_from_settings`);
    required, so that no component can forget it and connect in the clear by accident.

    ``wait`` retries a refused connection for that many seconds: under ``up`` and in
    compose the server may still be starting when a component starts.

    With tracing on (:mod:`modelkeeper.infra.tracing`), the client carries the SDK's
    OpenTelemetry interceptor, and so does every worker built on it: a workflow started
    inside a span (an API request's) continues its trace, through its activities, on
    whichever worker runs them.
    """
    deadline = time.monotonic() + wait
    interceptors = _tracing_interceptors()
    while True:
        try:
            return await Client.connect(
                address,
                namespace=namespace,
                data_converter=pydantic_data_converter,
                # False, not None: with no TLS configured the SDK must not decide on its own.
                tls=security.tls if security.tls is not None else False,
                api_key=security.api_key,
                interceptors=interceptors,
            )
        except (RPCError, RuntimeError, OSError):
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


def _tracing_interceptors() -> list[Interceptor]:
    """The SDK's OpenTelemetry interceptor while this process traces; none otherwise.

    The interceptor (not the newer, experimental ``OpenTelemetryPlugin``): a deployment's
    workflow runs for as long as the deployment lives, and the plugin reports a workflow's
    spans only once it completes. The interceptor's workflow spans are instants, made
    outside the sandbox (through its extern function) and never on replay, so they change
    no command and need no passthrough. A workflow started outside any span (with the
    ``temporal`` CLI, say) makes none."""
    if not tracing.ON:
        return []
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return [TracingInterceptor(tracing.tracer("temporalio"))]


async def signal_unplaceable(client: Client, deployment_ids: list[str]) -> int:
    """Tell deployments waiting for room (cant_place, or degraded with a replacement that
    found none) that the nodes changed, so they retry now rather than at their next timer.
    Returns how many were signalled."""
    sent = 0
    for deployment_id in deployment_ids:
        handle = client.get_workflow_handle(deployment_workflow_id(DeploymentId(deployment_id)))
        try:
            await handle.signal(SIGNAL_NODES_CHANGED)
            sent += 1
        except RPCError:
            continue  # it finished meanwhile (deleted): nothing to retry
    return sent


@overload
async def execute_update(handle: WorkflowHandle[_W, Any],
                         update: UpdateMethodMultiParam[[_W, _A], Coroutine[Any, Any, _R]],
                         arg: _A, *, id: str | None = None,
                         rpc_timeout: timedelta | None = None) -> _R: ...


@overload
async def execute_update(handle: WorkflowHandle[_W, Any],
                         update: UpdateMethodMultiParam[[_W, _A], _R], arg: _A, *,
                         id: str | None = None, rpc_timeout: timedelta | None = None) -> _R: ...


async def execute_update(handle: WorkflowHandle[Any, Any], update: Any, arg: Any, *,
                         id: str | None = None, rpc_timeout: timedelta | None = None) -> Any:
    """``handle.execute_update(update, arg)`` for an update referenced by method, typed by
    what the handler returns.

    Why not the SDK's own: ``@workflow.update(name=...)`` on an ``async def`` types the
    handler's result as its coroutine, so ``await handle.execute_update(W.move, request)``
    reads to mypy as a coroutine, not the move's outcome. The first overload unwraps that;
    the second takes a handler whose result the SDK types right (``@workflow.update`` with
    no name). Either way mypy checks the argument against the handler's parameter, and the
    SDK takes the update's name and result type from the handler at run time."""
    return await handle.execute_update(update, arg, id=id, rpc_timeout=rpc_timeout)
