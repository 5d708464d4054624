"""Secrets scrubbed from text before it leaves a process: the one scrubber.

Every place where text that might hold a secret leaves a process goes through
:func:`scrub_secrets`: each engine's log (written by :mod:`agent.log_filter`), the log
tails and probe details an agent sends to Temporal (``ShardExit``), and the log lines of
every component (:mod:`modelkeeper.infra.logs`).

What it replaces with :data:`REDACTED`, in this order of certainty:

1. **the values it is given** (``known``): the exact key an engine was started with,
   wherever it shows, even in a form rule 2 would miss;
2. **anything with our prefix**: ``mk`` and at most one letter, ``-``, then 32 or more
   key characters. Today that is an engine key (``mk-``), a node key (``mkn-``), a node
   credential or client API key (``mkc-``) and an operator token (``mko-``); a prefix
   added later is covered without a change here;
3. **a run of 64 or more hex digits**: the cluster secret (``secrets.token_hex(32)``),
   and any of our keys whose prefix was cut off. A SHA-256 digest reads the same and is
   scrubbed too: a log line loses a digest, which costs less than a secret.

**Escaped forms.** A secret may be written with escapes: ``mk\\u002d…`` in JSON,
``\\x2d`` in a Python repr, ``%2D`` in a URL, any character of it escaped, or escaped
again by a JSON string inside a JSON string. So the text is also read with its escapes
decoded (each escape as the one character it stands for), up to :data:`DECODE_ROUNDS`
times over, and the rules above are applied to every reading. A match is mapped back to
the part of the original text it was read from, and that whole part, escapes included,
is replaced. Everything else is returned exactly as it came.

Pure: no I/O, no state. Fast when there is nothing to find: one regular-expression
search, plus one per decoded reading when the text holds escapes.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Iterator

#: What a scrubbed secret reads as.
REDACTED = "mk-<redacted>"

#: A prefixed secret needs at least this many key characters after its prefix: 32 is well
#: under every real one (64 hex digits, or 43 base64url characters) and well over any
#: word a log line would put after "mk-".
MIN_SECRET_CHARS = 32
#: A bare secret: the cluster secret is 64 hex digits (32 random bytes).
MIN_HEX_CHARS = 64
#: A known value shorter than this is not searched for: an empty or tiny "key" (the sim
#: may run with none) would match everywhere and redact the whole log.
MIN_KNOWN_CHARS = 16
#: How many layers of escaping are looked through: JSON (1), JSON inside a JSON string
#: (2), and that inside a Python repr (3). Each costs one more pass over text that holds
#: escapes.
DECODE_ROUNDS = 3

_SECRET = re.compile(
    r"mk[a-z]?-[A-Za-z0-9_\-]{" + str(MIN_SECRET_CHARS) + r",}"
    r"|[0-9A-Fa-f]{" + str(MIN_HEX_CHARS) + r",}")

#: One escape: JSON's and Python's \u, Python's \U and \x, a URL's %XX, and a backslash
#: before any other character (\" \' \\ \/ \n...), which stands for that character.
_ESCAPE = re.compile(
    r"\\u([0-9A-Fa-f]{4})|\\U([0-9A-Fa-f]{8})|\\x([0-9A-Fa-f]{2})|%([0-9A-Fa-f]{2})"
    r"|\\(.)", re.DOTALL)
#: What a backslash before a letter stands for, where it is not the letter itself: the
#: whitespace that separates a secret from what follows.
_CONTROL_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": " ", "f": " ", "v": " ", "0": " "}
#: The characters a secret of rules 2 and 3 holds, and those that start an escape.
_SIGNIFICANT = frozenset(string.ascii_letters + string.digits + "_-\\%")


def _unescape(match: re.Match[str]) -> str:
    """The one character an escape stands for."""
    code = match.group(1) or match.group(2) or match.group(3) or match.group(4)
    if code is not None:
        value = int(code, 16)
        # \U escapes can name a code point past Unicode's end: no character, no secret.
        return chr(value) if value <= 0x10FFFF else "\ufffd"
    char = match.group(5)
    return _CONTROL_ESCAPES.get(char, char)


def _decode(text: str, significant: frozenset[str]) -> tuple[str, list[int]] | None:
    """``text`` with each escape read as its character, and where each character of the
    result begins in ``text`` (one entry more: ``len(text)``). Each escape is one
    character of the result, each other character itself, so a match from i to j in the
    result came from ``starts[i]`` to ``starts[j]``.

    None when no escape stands for a ``significant`` character (one a secret may hold, or
    one that starts an escape): reading the others (``\\"`` in JSON, ``\\n``) only
    swaps a character no secret holds for another, so it can reveal nothing, and most
    log lines with escapes are spared the work.
    """
    escapes = list(_ESCAPE.finditer(text))
    chars = [_unescape(match) for match in escapes]
    if not any(char in significant for char in chars):
        return None
    pieces: list[str] = []
    starts: list[int] = []
    pos = 0
    for match, char in zip(escapes, chars, strict=True):
        begin = match.start()
        pieces.append(text[pos:begin])
        starts.extend(range(pos, begin))
        pieces.append(char)
        starts.append(begin)
        pos = match.end()
    pieces.append(text[pos:])
    starts.extend(range(pos, len(text) + 1))
    return "".join(pieces), starts


@functools.lru_cache(maxsize=64)
def _rules(known: tuple[str, ...]) -> tuple[re.Pattern[str], frozenset[str]]:
    """The rules as one pattern, the known values first (longest first, so that a value
    that holds another is taken whole); and the characters an escape must stand for to
    matter (see :func:`_decode`)."""
    values = sorted({v for v in known if len(v) >= MIN_KNOWN_CHARS}, key=len, reverse=True)
    significant = _SIGNIFICANT.union(*values)
    if not values:
        return _SECRET, significant
    return re.compile("|".join([*map(re.escape, values), _SECRET.pattern])), significant


def _spans(text: str, known: tuple[str, ...]) -> Iterator[tuple[int, int]]:
    """Where secrets lie in ``text``, in every reading, as spans of ``text`` itself."""
    pattern, significant = _rules(known)
    view = text
    to_text: list[int] | None = None  # where each character of view begins in text
    for _ in range(DECODE_ROUNDS + 1):
        for match in pattern.finditer(view):
            begin, end = match.span()
            yield (begin, end) if to_text is None else (to_text[begin], to_text[end])
        decoded = _decode(view, significant)
        if decoded is None:
            return
        view, starts = decoded
        to_text = starts if to_text is None else [to_text[s] for s in starts]


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def scrub_secrets(text: str, *, known: Iterable[str] = ()) -> str:
    """``text`` with every secret in it replaced by :data:`REDACTED` (the rules are in the
    module docstring); ``known``: values to scrub wherever they show, whatever they look
    like (the key an engine was given)."""
    spans = _merged(_spans(text, tuple(known)))
    if not spans:
        return text
    out: list[str] = []
    pos = 0
    for begin, end in spans:
        out.append(text[pos:begin])
        out.append(REDACTED)
        pos = end
    out.append(text[pos:])
    return "".join(out)
