"""What the gateway decides about a request's body before it is sent (tokens per request,
a request with nothing to answer), and the one shape of every error it answers, its own
and an engine's. Pure: no server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway import responses
from gateway.admission import bound_max_tokens, request_problem
from gateway.responses import ErrorReply, engine_error

pytestmark = pytest.mark.timeout(10)


def sent(payload: dict[str, Any], bound: int | None = None, **model: int | None) -> Any:
    """The payload as the engine would read the body the gateway sends (the last of a
    repeated member wins, as with every JSON parser the engines use)."""
    body = json.dumps(payload).encode()
    result = bound_max_tokens(payload, body, bound, **model)
    return result if isinstance(result, ErrorReply) else json.loads(result.body)


def test_no_bound_leaves_the_body_as_it_came() -> None:
    body = b'{"model": "m", "prompt": "x"}'
    assert bound_max_tokens(json.loads(body), body, None) == (body, None)


def test_the_models_default_is_sent_when_the_request_names_none() -> None:
    ask = {"model": "m", "prompt": "x"}
    assert sent(ask, model_default=256, model_limit=1024)["max_tokens"] == 256
    # The limit alone is the default too: a request naming none must not run away.
    assert sent(ask, model_limit=1024)["max_tokens"] == 1024
    # Within the gateway's bound per key, whichever is smaller.
    assert sent(ask, 100, model_default=256)["max_tokens"] == 100
    assert sent(ask, 1000, model_default=256)["max_tokens"] == 256


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_asking_for_more_than_the_models_limit_is_lowered_to_it(field: str) -> None:
    assert sent({"model": "m", field: 5000}, model_default=256, model_limit=1024)[field] \
        == 1024
    # Within it: as asked.
    body = json.dumps({"model": "m", field: 1000}).encode()
    assert bound_max_tokens(json.loads(body), body, None, model_limit=1024) == (body, None)


def test_the_gateways_bound_still_refuses_what_is_over_it() -> None:
    reply = sent({"model": "m", "max_tokens": 900}, 800, model_limit=1024)
    assert isinstance(reply, ErrorReply) and reply.status == 400
    assert (reply.code, reply.param) == ("max_tokens_exceeded", "max_tokens")
    assert "900" in reply.message and "800" in reply.message
    # Under the gateway's bound, over the model's limit: lowered, not refused.
    assert sent({"model": "m", "max_tokens": 900}, 2000, model_limit=600)["max_tokens"] == 600


def test_a_length_of_minus_one_asks_for_the_most_and_gets_it() -> None:
    # llama.cpp reads -1 as "as many as the context allows"; benchmark clients send it.
    assert sent({"model": "m", "max_tokens": -1}, model_default=256,
                model_limit=512)["max_tokens"] == 512
    assert sent({"model": "m", "max_tokens": -1}, 100, model_limit=512)["max_tokens"] == 100
    # No bound at all: the engine's to judge, as sent.
    assert sent({"model": "m", "max_tokens": -1}) == {"model": "m", "max_tokens": -1}


def test_the_gateway_says_which_length_it_set_and_why() -> None:
    body = b'{"model": "m", "prompt": "x"}'
    filled = bound_max_tokens(json.loads(body), body, None, model_default=256)
    assert not isinstance(filled, ErrorReply) and filled.output_limit is not None
    assert filled.output_limit.startswith(b"max_tokens=256; the default")
    body = b'{"model": "m", "max_tokens": 2000}'
    lowered = bound_max_tokens(json.loads(body), body, None, model_limit=512)
    assert not isinstance(lowered, ErrorReply)
    assert lowered.output_limit == (
        b"max_tokens=512; lowered from 2000, the most this model allows per request")


@pytest.mark.parametrize("value", ["64", True, 0, -3, 2.5])
def test_a_max_tokens_that_is_no_count_is_a_400_naming_it_while_a_bound_applies(
        value: object) -> None:
    reply = sent({"model": "m", "max_tokens": value}, model_limit=64)
    assert isinstance(reply, ErrorReply) and reply.status == 400
    assert reply.param == "max_tokens" and repr(value) in reply.message
    assert "from 1 to 64" in reply.message


@pytest.mark.parametrize(("path", "payload", "param"), [
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
    ("/v1/completions", {"model": "m", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "m"}, "prompt"),
])
def test_a_request_with_nothing_to_answer_is_a_400_naming_the_field(
        path: str, payload: dict[str, Any], param: str) -> None:
    reply = request_problem(path, payload)
    assert reply is not None and reply.status == 400 and reply.param == param
    assert f"`{param}` is" in reply.message


@pytest.mark.parametrize(("path", "payload"), [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": ""}]}),
    ("/v1/completions", {"model": "m", "prompt": "x"}),
    ("/v1/completions", {"model": "m", "prompt": [1, 2]}),
])
def test_anything_else_is_the_engines_to_judge(path: str, payload: dict[str, Any]) -> None:
    assert request_problem(path, payload) is None


def _shape(body: bytes) -> dict[str, Any]:
    """The error object, checked to be OpenAI's: four fields, a string code, a string or
    null param."""
    error = json.loads(body)["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return dict(error)


@pytest.mark.parametrize(("status", "body", "expected"), [
    # llama.cpp: a numeric code, no param.
    (400, b'{"error": {"code": 400, "message": "bad grammar", "type": '
          b'"invalid_request_error"}}',
     {"message": "bad grammar", "type": "invalid_request_error", "param": None,
      "code": "invalid_request"}),
    # llama.cpp's context overflow: its token counts are kept, for the client to act on.
    (400, b'{"error": {"code": 400, "message": "the request exceeds the available context '
          b'size, try increasing it", "type": "exceed_context_size_error", '
          b'"n_prompt_tokens": 1210, "n_ctx": 512, "trace": [' + b'1,' * 50 + b'1]}}',
     {"message": "the request exceeds the available context size, try increasing it",
      "type": "exceed_context_size_error", "param": None, "code": "invalid_request",
      "n_prompt_tokens": 1210, "n_ctx": 512}),
    # Older vLLM and SGLang: the fields at the top level.
    (400, b'{"object": "error", "message": "max_tokens too large", "type": '
          b'"BadRequestError", "param": "max_tokens", "code": 400}',
     {"message": "max_tokens too large", "type": "BadRequestError", "param": "max_tokens",
      "code": "invalid_request"}),
    # OpenAI's own shape passes as it is.
    (404, b'{"error": {"message": "no such model", "type": "invalid_request_error", '
          b'"param": "model", "code": "model_not_found"}}',
     {"message": "no such model", "type": "invalid_request_error", "param": "model",
      "code": "model_not_found"}),
    # A FastAPI server's own error, TGI's, plain text, nothing at all.
    (422, b'{"detail": "Unprocessable"}',
     {"message": "Unprocessable", "type": "invalid_request_error", "param": None,
      "code": "invalid_request"}),
    (424, b'{"error": "Input validation error", "error_type": "validation"}',
     {"message": "Input validation error", "type": "validation", "param": None,
      "code": "engine_error"}),
    (500, b"<html>Internal Server Error</html>",
     {"message": "<html>Internal Server Error</html>", "type": "upstream_error",
      "param": None, "code": "engine_error"}),
    (503, b"", {"message": "the engine answered HTTP 503 with no message",
                "type": "upstream_error", "param": None, "code": "engine_unavailable"}),
    (400, b"[" * 100_000, {"message": "[" * 500, "type": "invalid_request_error",
                           "param": None, "code": "invalid_request"}),
])
def test_an_engines_error_is_rewritten_into_the_one_shape(
        status: int, body: bytes, expected: dict[str, Any]) -> None:
    reply = engine_error(status, body)
    assert reply.status == status
    assert _shape(reply.body()) == expected


def test_an_engines_error_event_midway_is_rewritten_and_the_rest_left_alone() -> None:
    token = b'data: {"choices":[{"delta":{"content":"\\"error\\""}}]}'
    llama = b'data: {"error":{"code":500,"message":"slot lost","type":"server_error"}}'
    chunk = token + b"\n\n" + llama + b"\n\n"
    events = responses.engine_error_events(chunk).split(b"\n\n")
    assert events[0] == token  # a token that says "error" is not an error
    assert _shape(events[1][len(b"data: "):]) == {
        "message": "slot lost", "type": "server_error", "param": None,
        "code": "engine_error"}
    assert events[2:] == [b""]
    plain = b'data: {"choices":[]}\n\n'
    assert responses.engine_error_events(plain) is plain  # the common case: no copy


@pytest.mark.parametrize("reply", [
    responses.bad_request("x"),
    responses.bad_request("x", "model_required", param="model"),
    responses.unauthorized("x"),
    responses.unknown_model("nope", ["a"]),
    responses.upstream_failed("m", "refused", waited_s=1.0),
])
def test_the_gateways_own_errors_have_the_shape(reply: ErrorReply) -> None:
    _shape(reply.body())


def test_the_stream_cut_event_has_the_shape() -> None:
    event = responses.sse_error_event("cut")
    _shape(event.split(b"\n\n")[0].removeprefix(b"data: "))
