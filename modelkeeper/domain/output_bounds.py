"""How much output one request may ask of an engine: the request fields, engine by engine,
that set how many tokens are generated or how many outputs, and the rules that bound them.
Pure: the gateway carries out the answer (``gateway.admission.bound_max_tokens``).

The gateway bounds ``max_tokens`` by the model's catalog limit and ``gateway_max_tokens``.
Each engine also reads fields of its own that set the same thing, and those bypassed the
bound while unchecked: llama.cpp's ``n_predict`` (it wins over ``max_tokens``; -1 means
"until the context is full") with ``ignore_eos`` returned 400 tokens against a limit of
64, and vLLM's ``n`` and ``best_of`` multiply a bounded length by as much as a client
likes. :data:`ENGINE_OUTPUT_FIELDS` lists them per engine, from each engine's OpenAI
request schema (llama.cpp's server, vLLM's and SGLang's ``protocol.py``); the gateway
cannot tell which engine serves a model (its database role reads no engine), and a field
an engine does not know is one it ignores, so it bounds them all (:data:`ALL_OUTPUT_FIELDS`).

The rules, in order (each refusal names the field, its value and the limit):

1. **A number is a JSON integer.** Where a rule applies, a string, a fraction or
   ``true`` is refused: engines parse leniently (pydantic reads ``"5"`` as 5), and the
   gateway must judge the number the engine will use.
2. **Length fields** (``max_tokens``, ``max_completion_tokens``, llama.cpp's
   ``n_predict``) are whole numbers of at least 1 while any bound applies; over the
   gateway's bound they are refused, over the model's limit lowered to it. -1, which
   llama.cpp reads as "as many as the context allows" and benchmark clients send, is
   lowered to the most that applies (issue 27: it was a 400).
3. **Minimum fields** (vLLM's and SGLang's ``min_tokens``) are at most the bound that
   applies: no engine can honour both, and some generate the minimum anyway.
4. **A request naming no OpenAI length field gets** ``max_tokens``: the model's default,
   else its limit, at most the gateway's bound. An engine-native length field does not
   count, since another engine ignores it: ``ignore_eos`` (llama.cpp, vLLM, SGLang) then
   still stops at the bound.
5. **Outputs per request** (``n``, ``best_of``, llama.cpp's ``n_cmpl``, times the prompts
   of a ``/v1/completions`` batch, which each get their own output) are at most
   ``max_choices`` (``gateway_max_choices``, 1 by default), bound or no bound.
6. **Alternatives per token** (``logprobs`` as a number, ``top_logprobs``, llama.cpp's
   ``n_probs``, vLLM's ``prompt_logprobs``) are from 0 to :data:`MAX_LOGPROBS`: each token
   of the answer carries that many, and vLLM reads -1 as "the whole vocabulary".
7. **Flags that multiply the answer's size** (SGLang's ``return_hidden_states``: a vector
   of thousands of numbers per token) are refused when on.

Anything else in the body is the engine's to judge. A field an engine adds in a later
version is not bounded until it is listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .shards import EngineKind

#: Most alternatives per token a request may ask for: OpenAI's own maximum for
#: ``top_logprobs``, and vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20


class OutputField(Enum):
    """What a request field sets about an engine's output."""

    #: The most tokens generated (rule 2).
    LENGTH = "length"
    #: The fewest tokens generated (rule 3).
    MINIMUM = "minimum"
    #: Outputs generated per prompt (rule 5).
    CHOICES = "choices"
    #: Alternatives returned per token (rule 6).
    LOGPROBS = "logprobs"
    #: A flag that multiplies the size of each token's answer (rule 7).
    REFUSED_FLAG = "refused_flag"


#: The OpenAI API's own fields, which every engine reads.
OPENAI_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")
_OPENAI: dict[str, OutputField] = {
    "max_tokens": OutputField.LENGTH, "max_completion_tokens": OutputField.LENGTH,
    "n": OutputField.CHOICES, "best_of": OutputField.CHOICES,
    "logprobs": OutputField.LOGPROBS, "top_logprobs": OutputField.LOGPROBS,
}

#: Per engine, every request field that sets how much it generates or returns.
ENGINE_OUTPUT_FIELDS: Mapping[EngineKind, Mapping[str, OutputField]] = {
    # llama.cpp's server: n_predict wins over max_tokens, -1 is unbounded; n_cmpl is its
    # number of completions per prompt; n_probs its alternatives per token.
    EngineKind.LLAMACPP: {**_OPENAI, "n_predict": OutputField.LENGTH,
                          "n_cmpl": OutputField.CHOICES, "n_probs": OutputField.LOGPROBS},
    # vLLM: min_tokens, and prompt_logprobs (alternatives for every prompt token).
    EngineKind.VLLM: {**_OPENAI, "min_tokens": OutputField.MINIMUM,
                      "prompt_logprobs": OutputField.LOGPROBS},
    # SGLang: min_tokens, and the hidden state of each token in the answer.
    EngineKind.SGLANG: {**_OPENAI, "min_tokens": OutputField.MINIMUM,
                        "return_hidden_states": OutputField.REFUSED_FLAG},
    # The sim reads max_tokens and max_completion_tokens only.
    EngineKind.SIM: {name: _OPENAI[name] for name in OPENAI_LENGTH_FIELDS},
}

#: Every engine's fields: what the gateway bounds, not knowing the engine.
ALL_OUTPUT_FIELDS: Mapping[str, OutputField] = {
    name: kind for fields in ENGINE_OUTPUT_FIELDS.values() for name, kind in fields.items()}


@dataclass(frozen=True, slots=True)
class OutputRefusal:
    """Why a request asks for more output than it may: a sentence naming the field, its
    value and the limit, and an error code for clients to match on."""

    field: str
    message: str
    code: str


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bound_output(payload: Mapping[str, Any], *, bound: int | None = None,
                 model_default: int | None = None, model_limit: int | None = None,
                 max_choices: int = 1) -> dict[str, int] | OutputRefusal:
    """The fields to set on ``payload`` so that it asks for no more output than it may
    (empty: send it as it is), or why it is refused. The rules are the module's, in order.

    ``bound``: the gateway's bound on tokens per request, for every key (refused over it);
    ``model_default`` and ``model_limit``: the model's catalog default for a request naming
    no length, and its limit (lowered to it); ``max_choices``: the most outputs (rule 5).

    On every request's path: plain arguments and one dict lookup per member of the body
    (a frozen dataclass of limits cost as much again as the whole check).
    """
    limit, default = model_limit, model_default
    bounded = bound is not None or limit is not None or default is not None
    most = limit if bound is None else bound if limit is None else min(bound, limit)
    lowered: dict[str, int] = {}
    named = False
    choices = 1
    choice_field = "n"
    for name, value in payload.items():
        kind = ALL_OUTPUT_FIELDS.get(name)
        if kind is None or value is None:
            continue
        match kind:
            case OutputField.LENGTH:
                named = named or name in OPENAI_LENGTH_FIELDS
                if not bounded:
                    continue
                if value == -1 and _is_count(value) and most is not None:
                    lowered[name] = most
                    continue
                if not _is_count(value) or value < 1:
                    allowed = f"from 1 to {most}" if most is not None else "of at least 1"
                    return OutputRefusal(name, f"`{name}` is {value!r}: it must be a whole "
                                         f"number of tokens {allowed}", "invalid_max_tokens")
                if bound is not None and value > bound:
                    return OutputRefusal(name, f"`{name}` is {value!r}; this gateway allows "
                                         f"at most {bound} tokens per request",
                                         "max_tokens_exceeded")
                if limit is not None and value > limit:
                    lowered[name] = limit
            case OutputField.MINIMUM:
                if most is None:
                    continue
                if not _is_count(value) or not 0 <= value <= most:
                    return OutputRefusal(name, f"`{name}` is {value!r}: it must be a whole "
                                         f"number of tokens from 0 to {most}, the most one "
                                         "request may generate", "min_tokens_exceeded")
            case OutputField.CHOICES:
                if not _is_count(value) or value < 1:
                    return OutputRefusal(name, f"`{name}` is {value!r}: it must be a whole "
                                         f"number from 1 to {max_choices}",
                                         "too_many_choices")
                if value > choices:
                    choices, choice_field = value, name
            case OutputField.LOGPROBS:
                # Chat's `logprobs` is a flag; a number elsewhere.
                if isinstance(value, bool) and name == "logprobs":
                    continue
                if not _is_count(value) or not 0 <= value <= MAX_LOGPROBS:
                    return OutputRefusal(name, f"`{name}` is {value!r}: it must be a whole "
                                         f"number of alternatives per token from 0 to "
                                         f"{MAX_LOGPROBS}", "too_many_logprobs")
            case OutputField.REFUSED_FLAG:
                if value is not False:
                    return OutputRefusal(name, f"`{name}` is {value!r}: this gateway does not "
                                         "pass it on (it multiplies the size of every "
                                         "token's answer); it may only be false",
                                         "unsupported_parameter")
    prompts = _prompts(payload.get("prompt"))
    if choices * prompts > max_choices:
        if prompts > 1:
            return OutputRefusal(
                "prompt", f"`prompt` is a batch of {prompts} prompts and `{choice_field}` "
                f"is {choices}: {choices * prompts} outputs; this gateway generates at most "
                f"{max_choices} per request", "too_many_choices")
        return OutputRefusal(
            choice_field, f"`{choice_field}` is {choices}; this gateway generates at most "
            f"{max_choices} output(s) per request", "too_many_choices")
    if not named and bounded:
        fill = default if default is not None else limit
        if bound is not None:
            fill = bound if fill is None else min(fill, bound)
        if fill is not None:
            lowered["max_tokens"] = fill
    return lowered


def _prompts(prompt: object) -> int:
    """How many prompts a completion's ``prompt`` holds: a list of texts or of token lists
    is a batch; a text, or one list of token ids, is one."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1
