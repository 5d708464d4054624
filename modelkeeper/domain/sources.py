"""Where a model's weights may come from: the source policy, and its verdict on one source.

Pure: it parses and compares, and never resolves a name, opens a file or follows a link.
The API judges a catalog entry's ``source`` with it before anything is stored, and the
agent judges the same source again, and every redirect on the way, before it downloads:
the agent must not trust the catalog blindly (a row may predate the policy, or have been
written by hand).

The rules, in order (each has its test in ``tests/security/test_sources_and_bounds.py``):

1. A URL (``scheme://...``):

   a. its scheme is allowed: ``https`` only by default, since ``http`` carries weights
      that nothing checks in the clear;
   b. it holds no credentials (``user:pass@``): they would sit in the catalog, the event
      history and every log that prints a source. A model names a secret instead
      (:func:`secret_env_var`);
   c. its host is allowed: listed exactly, or under a listed ``*.suffix``. ``*`` allows any
      host name, but still no loopback, private, link-local or otherwise special address,
      nor ``localhost``, unless that host is listed by itself: the agent would fetch from
      its own network (a cloud's metadata service, an engine) on the catalog's say-so. An
      empty list allows no host: downloads are off.

2. A path (``/...``): absolute, with no ``..`` segment, and under an allowed local root.
   ``~`` is refused: it names a different home on each machine that reads it.

3. Anything else is a name: the packaged ``smollm2``, a Hugging Face repo id ``org/name``
   (read offline from the node's cache), or a sim label. One or two segments of letters,
   digits, ``.``, ``_`` and ``-``, each starting with a letter or digit, so that a name can
   be neither a path nor a flag on an engine's command line.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import PurePosixPath
from urllib.parse import urlsplit

#: The schemes the agent knows how to download; a policy may allow no others.
KNOWN_SCHEMES = frozenset({"https", "http"})
#: Hugging Face's hub and the hosts it redirects downloads to (its LFS and Xet CDNs).
HUGGING_FACE_HOSTS = ("huggingface.co", "*.huggingface.co", "hf.co", "*.hf.co")
#: A host entry allowing any host name (never a special address; rule 1c).
ANY_HOST = "*"
#: Large enough for one file of the largest open models at 8 bits (Llama 3.1 405B is about
#: 430 GB in one GGUF at Q8_0), small enough that a runaway or hostile server cannot fill
#: a node's disk many times over.
DEFAULT_MAX_DOWNLOAD_BYTES = 512 << 30

#: A model's ``secret`` names the environment variable ``MODELKEEPER_SOURCE_TOKEN_<NAME>``
#: on the agent. The prefix keeps a catalog entry from naming any other variable (the
#: engine key secret, a cloud credential) and having the agent send it to a download host.
SECRET_ENV_PREFIX = "MODELKEEPER_SOURCE_TOKEN_"
#: What a ``secret`` may be: the suffix of that variable's name.
SECRET_NAME_PATTERN = r"^[A-Z0-9][A-Z0-9_]{0,63}$"
#: A catalog entry's ``sha256``: 64 lowercase hex digits.
SHA256_PATTERN = r"^[0-9a-f]{64}$"

_NAME_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_NAME = re.compile(rf"^{_NAME_SEGMENT}(/{_NAME_SEGMENT})?$")
#: A host name's top-level label starts with a letter (no TLD is numeric).
_LAST_LABEL = re.compile(r"(^|\.)[a-z][a-z0-9-]*$")


class SourceKind(StrEnum):
    """What a source is, by its form (the rules above)."""

    URL = "url"
    PATH = "path"
    NAME = "name"


@dataclass(frozen=True, slots=True)
class SourcePolicy:
    """Which sources a model may have. Built from settings by
    :func:`modelkeeper.infra.model_files.source_policy`, which fills in the default roots."""

    schemes: frozenset[str] = frozenset({"https"})
    #: Exact host names, ``*.suffix`` for the hosts under a domain, or ``*`` (rule 1c).
    hosts: tuple[str, ...] = HUGGING_FACE_HOSTS
    #: Absolute, normalised folders under which a local path may lie.
    local_roots: tuple[PurePosixPath, ...] = ()
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES


@dataclass(frozen=True, slots=True)
class SourceAllowed:
    """The source passes the policy."""

    kind: SourceKind


@dataclass(frozen=True, slots=True)
class SourceRefused:
    """The source breaks a rule: ``rule`` says which, in a sentence about ``value``."""

    kind: SourceKind
    value: str
    rule: str

    @property
    def message(self) -> str:
        """The sentence for a user: the value and the rule it breaks."""
        return f"source {self.value!r} is refused: {self.rule}"


SourceVerdict = SourceAllowed | SourceRefused


def source_kind(source: str) -> SourceKind:
    """The rule a source falls under, by its form alone."""
    if "://" in source:
        return SourceKind.URL
    if source.startswith(("/", "~")):
        return SourceKind.PATH
    return SourceKind.NAME


def check_source(policy: SourcePolicy, source: str) -> SourceVerdict:
    """The policy's verdict on ``source`` (rules 1 to 3 of the module docstring)."""
    match source_kind(source):
        case SourceKind.URL:
            return check_url(policy, source)
        case SourceKind.PATH:
            return check_path(policy, source)
        case SourceKind.NAME:
            if _NAME.match(source) is None:
                return SourceRefused(
                    SourceKind.NAME, source,
                    "a source that is neither a URL nor an absolute path must be a name "
                    "(a packaged model, a Hugging Face repo id such as org/name, or a sim "
                    "label) of letters, digits, '.', '_' and '-', each part starting with "
                    "a letter or digit")
            return SourceAllowed(SourceKind.NAME)


def check_url(policy: SourcePolicy, url: str) -> SourceVerdict:
    """Rule 1, for a catalog entry's URL and for every redirect the agent is sent on."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        # Reading the port validates it: urlsplit accepts "host:99999" until asked.
        _ = parts.port
    except ValueError as exc:
        return SourceRefused(SourceKind.URL, url, f"not a well-formed URL ({exc})")
    scheme = parts.scheme.lower()
    if scheme not in policy.schemes:
        allowed = ", ".join(sorted(policy.schemes)) or "none"
        return SourceRefused(SourceKind.URL, url,
                             f"scheme {scheme!r} is not allowed (allowed: {allowed})")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        return SourceRefused(
            SourceKind.URL, url,
            "credentials in a URL are refused (they would be stored and logged with it); "
            f"name a secret instead: the agent sends ${SECRET_ENV_PREFIX}<secret> as a "
            "bearer token")
    if not host:
        return SourceRefused(SourceKind.URL, url, "a URL needs a host")
    refusal = host_refusal(policy.hosts, host)
    if refusal is not None:
        return SourceRefused(SourceKind.URL, url, refusal)
    return SourceAllowed(SourceKind.URL)


def host_refusal(hosts: Iterable[str], host: str) -> str | None:
    """Why ``host`` (lower case, as urlsplit gives it) matches no entry (rule 1c); None
    when one allows it."""
    host = host.rstrip(".")
    listed = tuple(entry.lower().rstrip(".") for entry in hosts)
    for entry in listed:
        if entry == host or (entry.startswith("*.") and host.endswith(entry[1:])):
            return None
    if ANY_HOST in listed:
        if not _special_host(host):
            return None
        return (f"host {host!r} is this machine or its network (loopback, private, "
                "link-local, or not a DNS name): allowed only when listed by itself, "
                "never by '*'")
    shown = ", ".join(listed) or "none: downloads are off"
    return f"host {host!r} is not an allowed host (allowed: {shown})"


def _special_host(host: str) -> bool:
    """A host the agent must not reach on a wildcard: its own machine or network."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        # A name is not resolved here (pure; see docs/security.md), but one whose last label
        # does not start with a letter is no DNS name: "2130706433", "0x7f.1" and "127.1"
        # are 127.0.0.1 to some URL parsers.
        return _LAST_LABEL.search(host) is None
    return not address.is_global


def check_path(policy: SourcePolicy, source: str) -> SourceVerdict:
    """Rule 2, on the path as written; the caller that reads the file checks again after
    resolving symbolic links (:func:`under_roots` on the resolved path)."""
    if source.startswith("~"):
        return SourceRefused(SourceKind.PATH, source,
                             "'~' names a different home on each machine; give an absolute "
                             "path")
    path = PurePosixPath(source)
    if ".." in path.parts:
        return SourceRefused(SourceKind.PATH, source, "a path must not contain '..'")
    if not under_roots(policy.local_roots, path):
        roots = ", ".join(str(r) for r in policy.local_roots) or "none"
        return SourceRefused(SourceKind.PATH, source,
                             f"not under an allowed local root (allowed: {roots})")
    return SourceAllowed(SourceKind.PATH)


def under_roots(roots: Iterable[PurePosixPath], path: PurePosixPath) -> bool:
    """Whether the absolute ``path``, normalised, is one of ``roots`` or lies under one."""
    if not path.is_absolute():
        return False
    normal = PurePosixPath(posixpath.normpath(path))
    return any(normal == root or root in normal.parents for root in roots)


def secret_env_var(secret: str) -> str:
    """The agent's environment variable that a model's ``secret`` names."""
    return SECRET_ENV_PREFIX + secret
