"""The blocks of a markdown page that a test runs as written.

A page marks each block a test should see with an HTML comment of its own, on the line
right above the block's fence (a reader never sees it):

    <!-- readme-test: any words -->
    ```sh
    modelkeeper ls
    ```

The marker's name says which test it is for (``readme-test``, ``first-hour``); the words
after the colon are that test's to read. A marker not followed by a fence stands alone
(``MarkedBlock.lang`` is None): an instruction with no code, such as "press Ctrl-C".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A fence's opening line: three backticks and an optional info string (the language).
_FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass(frozen=True)
class MarkedBlock:
    """One marked place of a page, in page order."""

    #: What follows the marker's colon, stripped ("" for a bare marker).
    words: str
    #: The fence's info string ("sh", "text"), "" for a bare fence, None for no fence.
    lang: str | None
    #: The fence's content, each line ending in a newline; "" without a fence.
    body: str
    #: The marker's line number, 1-based, to name it in a failure.
    line: int


@dataclass(frozen=True)
class Fence:
    """Any fenced block of a page, marked or not."""

    lang: str
    body: str
    #: The fence's opening line number, 1-based.
    line: int
    #: The marker comment right above it, if any.
    marker: str | None


def fences(text: str) -> list[Fence]:
    """Every fenced block of ``text``, in order, with the comment right above it."""
    lines = text.splitlines(keepends=True)
    found: list[Fence] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].rstrip("\n") != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"line {i + 1}: a fence that is never closed")
        above = lines[i - 1].strip() if i > 0 else ""
        marker = above if above.startswith("<!--") and above.endswith("-->") else None
        found.append(Fence(lang=opening.group(1), body="".join(lines[i + 1:end]),
                           line=i + 1, marker=marker))
        i = end + 1
    return found


def marked_blocks(text: str, marker: str) -> list[MarkedBlock]:
    """Every ``<!-- MARKER[: words] -->`` of ``text`` and the fence right below it."""
    comment = re.compile(rf"^<!--\s*{re.escape(marker)}(?::\s*(.*?))?\s*-->\s*$")
    lines = text.splitlines(keepends=True)
    by_line = {f.line: f for f in fences(text)}
    blocks = []
    for number, line in enumerate(lines, start=1):
        match = comment.match(line)
        if match is None:
            continue
        fence = by_line.get(number + 1)
        blocks.append(MarkedBlock(words=(match.group(1) or "").strip(),
                                  lang=None if fence is None else fence.lang,
                                  body="" if fence is None else fence.body, line=number))
    return blocks


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block, one per line, as a person types them: a line ending
    in a backslash is joined with the next, as the shell does; blank lines are dropped."""
    commands: list[str] = []
    command = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            command += line.rstrip()[:-1] + " "
            continue
        command += line
        if command.strip():
            commands.append(command.strip())
        command = ""
    return commands
