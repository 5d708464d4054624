"""The scrubber (modelkeeper.domain.redact) and the log filter's line handling
(agent.log_filter), as properties: whatever surrounds a secret, and however it is written,
nothing of it comes out; text without secrets comes out unchanged."""

from __future__ import annotations

import codecs
import json
import re
import string
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.log_filter import LineScrubber, pump, secret_values, take_secrets
from modelkeeper.domain.redact import REDACTED, scrub_secrets

pytestmark = pytest.mark.timeout(120)

HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
URLSAFE43 = st.text(string.ascii_letters + string.digits + "-_", min_size=43, max_size=43)
#: Every kind of secret a modelkeeper process holds: engine and node keys (64 hex digits),
#: node credentials, client keys and operator tokens (43 base64url characters), the
#: cluster secret (64 bare hex digits).
SECRETS = st.one_of(
    st.builds(str.__add__, st.sampled_from(["mk-", "mkn-"]), HEX64),
    st.builds(str.__add__, st.sampled_from(["mkc-", "mko-"]), URLSAFE43),
    HEX64,
)
#: A whole secret, as SECRETS draws them.
SECRETS_PATTERN = re.compile(r"mk[a-z]?-[A-Za-z0-9_\-]{32,}|[0-9a-f]{64}")
#: Text around a secret that an independent decoder can read back: no escapes of its own.
PLAIN = st.text(st.characters(codec="ascii", exclude_characters="\\%", exclude_categories=["Cc"]),
                max_size=40)


@st.composite
def escaped(draw: st.DrawFn, secret: str) -> str:
    """``secret`` with some of its characters escaped, each its own way."""
    out = []
    for char in secret:
        how = draw(st.sampled_from(["plain", "plain", "u", "x", "percent"]))
        match how:
            case "u":
                out.append(f"\\u{ord(char):04x}")
            case "x":
                out.append(f"\\x{ord(char):02x}")
            case "percent":
                out.append(f"%{ord(char):02X}")
            case _:
                out.append(char)
    return "".join(out)


@st.composite
def written(draw: st.DrawFn) -> tuple[str, str]:
    """(a secret, the secret as a log might write it)."""
    secret = draw(SECRETS)
    form = draw(st.one_of(st.just(secret), escaped(secret)))
    # Then wrapped: in JSON, JSON inside JSON, or a Python repr (each escapes the
    # backslashes of the layer below).
    for wrap in draw(st.lists(st.sampled_from(["json", "repr", "dict"]), max_size=2)):
        match wrap:
            case "json":
                form = json.dumps(form)
            case "repr":
                form = repr(form)
            case _:
                form = repr({"api_key": form})
    return secret, form


def _readings(text: str) -> list[str]:
    """``text`` as an independent reader decodes it: URL-decoded, escapes read (Python's
    decoder), up to four times over."""
    readings = [text, unquote(text)]
    for _ in range(4):
        try:
            text = codecs.decode(text.encode("ascii", "backslashreplace"), "unicode_escape")
        except UnicodeDecodeError:
            break
        readings += [text, unquote(text)]
    return readings


def _holds_any_of(text: str, secret: str) -> bool:
    body = secret.split("-", 1)[1] if secret.startswith("mk") else secret
    windows = {body[i:i + 16] for i in range(len(body) - 15)}
    return any(w in reading for reading in _readings(text) for w in windows)


@settings(max_examples=400, deadline=None)
@given(written(), PLAIN, PLAIN)
def test_no_secret_survives_in_any_form(case: tuple[str, str], before: str, after: str) -> None:
    secret, form = case
    out = scrub_secrets(before + form + after)
    assert not _holds_any_of(out, secret), out
    assert REDACTED in out


@settings(max_examples=200, deadline=None)
@given(SECRETS, st.text(max_size=40), st.text(max_size=40))
def test_a_plain_secret_goes_whatever_surrounds_it(secret: str, before: str, after: str) -> None:
    out = scrub_secrets(before + secret + after)
    body = secret.split("-", 1)[1] if secret.startswith("mk") else secret
    assert not any(body[i:i + 16] in out for i in range(len(body) - 15))


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=16, max_size=30), st.text(max_size=40), st.text(max_size=40))
def test_a_known_value_goes_whatever_it_looks_like(value: str, before: str, after: str) -> None:
    out = scrub_secrets(before + value + after, known=[value])
    assert value not in out


_KEYLIKE = re.compile(r"[A-Za-z0-9_\-]{32}|[0-9A-Fa-f]{64}")


@settings(max_examples=400, deadline=None)
@given(st.text(st.characters(exclude_characters="\\%")))
def test_text_without_secrets_passes_unchanged(text: str) -> None:
    if _KEYLIKE.search(text):
        return  # hardly ever drawn: a run of 32 key characters
    assert scrub_secrets(text) == text


# Short values only: no run of 32 key characters can form, escapes read or not.
_SHORT = st.text(max_size=20)
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), _SHORT),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(_SHORT, inner, max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_JSON)
def test_json_log_lines_without_secrets_pass_unchanged(value: object) -> None:
    for line in (json.dumps(value), json.dumps(json.dumps(value)), repr(value)):
        assert scrub_secrets(line) == line


@settings(max_examples=200, deadline=None)
@given(written(), PLAIN)
def test_scrubbing_twice_changes_nothing_more(case: tuple[str, str], around: str) -> None:
    once = scrub_secrets(around + case[1] + around)
    assert scrub_secrets(once) == once


def test_ordinary_log_lines_pass_unchanged() -> None:
    for line in (
        'INFO:     127.0.0.1:53122 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01]",
        "server_args=ServerArgs(model_path='/models/qwen', api_key=None, port=30000)",
        r'{"msg": "a \"quoted\" word\nand a new line", "path": "C:\\models"}',
        "mk-short stays, and so does a 40-char hex id 0123456789abcdef0123456789abcdef01234567",
    ):
        assert scrub_secrets(line) == line


def test_a_sha256_digest_goes_too() -> None:
    # It reads like the cluster secret: a documented cost.
    digest = "ab" * 32
    assert scrub_secrets(f"sha256 {digest}") == f"sha256 {REDACTED}"


# -- the log filter's lines ------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(PLAIN, written().map(lambda case: case[1])), max_size=8),
       st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=20))
def test_the_filter_writes_what_the_scrubber_would_however_the_output_is_cut(
        lines: list[str], cuts: list[int]) -> None:
    data = "".join(line + "\n" for line in lines).encode()
    scrubber = LineScrubber(())
    out, pos, index = b"", 0, 0
    while pos < len(data):
        size = cuts[index % len(cuts)]
        out += scrubber.feed(data[pos:pos + size])
        pos, index = pos + size, index + 1
    out += scrubber.close()
    assert out.decode() == scrub_secrets(data.decode())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(PLAIN.filter(bool), SECRETS), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=37))
def test_a_long_line_is_cut_where_no_secret_is_split(words: list[str], chunk: int) -> None:
    data = " ".join(words).encode()  # one line, longer than the filter holds
    scrubber = LineScrubber((), max_pending=100)
    parts = [scrubber.feed(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    out = b"".join(parts) + scrubber.close()
    for word in words:
        if SECRETS_PATTERN.fullmatch(word):
            assert word.encode() not in out
            assert word[-20:].encode() not in out


def test_the_filter_keeps_bytes_that_are_not_utf8() -> None:
    scrubber = LineScrubber(())
    assert scrubber.feed(b"caf\xe9 \xff\n") == b"caf\xe9 \xff\n"


def test_the_filter_scrubs_the_values_it_was_given() -> None:
    key = "not-like-our-keys-at-all!"
    scrubber = LineScrubber((key,))
    assert scrubber.feed(f"key {key}\n".encode()) == f"key {REDACTED}\n".encode()


def test_a_log_that_cannot_be_written_loses_lines_but_never_blocks_the_engine() -> None:
    chunks = iter([b"one\n", b"two\n", b"three\n", b""])
    written_out: list[bytes] = []
    failing = iter([True, True, False, False, False])

    def write(data: bytes) -> None:
        if next(failing):
            raise OSError(28, "No space left on device")
        written_out.append(data)

    assert pump(lambda: next(chunks), write, LineScrubber(())) == 0
    assert written_out == [b"[log filter: 8 bytes of output lost: the log could not be "
                           b"written]\n", b"three\n"]


def test_the_filter_takes_its_secrets_out_of_its_environment() -> None:
    env = {"MODELKEEPER_LOG_FILTER_SECRETS": "a-key\nanother", "PATH": "/bin"}
    assert take_secrets(env) == ["a-key", "another"]
    assert env == {"PATH": "/bin"}
    engine_env = {"VLLM_API_KEY": "k1", "HF_TOKEN": "", "PATH": "/bin", "LANG": "C"}
    assert secret_values(engine_env, ("KEY", "TOKEN")) == ["k1"]
