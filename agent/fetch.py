"""Fetching model weights to the node, once per source however many shards ask.

The agent does not trust the catalog blindly: a row may predate the source policy, or
have been written by hand. So every download is judged again here, by this agent's own
policy (:mod:`modelkeeper.domain.sources`), and so is every redirect on the way, before a
byte is requested from it. A download stops:

* when its server sends more than the policy's ``max_download_bytes`` (or says it will);
* when the last start waiting for it gives up (its activity is cancelled): nobody would
  use the file, and it would go on filling the disk;
* when its digest differs from the catalog's ``sha256``: the file is removed before any
  engine reads it.

A model that needs a token names a secret; the token itself is this agent's environment
variable ``MODELKEEPER_SOURCE_TOKEN_<secret>``, sent as a bearer token to the source's own
host only (never on to a redirect's other host).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from modelkeeper.domain.engine_args import EngineConfigError
from modelkeeper.domain.shards import FetchProgress
from modelkeeper.domain.sources import (
    SourcePolicy,
    SourceRefused,
    check_url,
    secret_env_var,
)
from modelkeeper.domain.start_progress import download_rate, keep_window
from modelkeeper.infra.model_files import source_policy
from modelkeeper.settings import Settings

ProgressCallback = Callable[[FetchProgress], None]

#: Redirects one download may follow, each judged by the policy. Hugging Face uses one
#: (to its CDN); a chain longer than this is a loop or a maze.
MAX_REDIRECTS = 5
#: Seconds of silence (connect, or between two reads) before a download fails.
FETCH_TIMEOUT_S = 30.0
#: How often every start waiting on a download reports its progress (its heartbeat).
PROGRESS_INTERVAL_S = 0.5
#: Bytes read, hashed and written at a time.
CHUNK_BYTES = 1 << 20
#: Beside each cached file, its SHA-256: a later start checks a catalog digest against it
#: without reading gigabytes again.
DIGEST_SUFFIX = ".sha256"


def is_remote(source: str) -> bool:
    """True for sources the agent must download (http or https URLs)."""
    return urlsplit(source).scheme in ("http", "https")


class FetchRefused(EngineConfigError):
    """A download the policy refuses: its source, a redirect, its size, its digest or its
    token. An :class:`EngineConfigError`, so a start fails at once rather than retrying."""


@dataclass
class _Download:
    """One download in flight, shared by every start waiting for its source."""

    future: asyncio.Future[Path]
    task: asyncio.Task[None] | None = None
    waiters: int = 0
    progress: FetchProgress = field(default_factory=lambda: FetchProgress(phase="fetching"))


class WeightFetcher:
    """Downloads weights into a cache folder; concurrent fetches of one source share one
    download (single flight), and later fetches reuse the file."""

    def __init__(self, cache_dir: Path, client: httpx.AsyncClient | None = None, *,
                 policy: SourcePolicy | None = None) -> None:
        """``policy``: the agent's source policy. None reads it from this process's
        environment (the settings the agent runs with), so that a fetcher built without
        one is never without a policy."""
        self._cache_dir = cache_dir
        self._client = client
        self._policy = policy if policy is not None else source_policy(Settings())
        self._inflight: dict[str, _Download] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # keeps running downloads referenced

    def cached_path(self, source: str) -> Path:
        """Where ``source`` lands: a hash keeps names unique, the suffix keeps the format."""
        name = Path(urlsplit(source).path).name or "weights"
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        return self._cache_dir / f"{digest}-{name}"

    async def fetch(self, source: str, on_progress: ProgressCallback, *,
                    sha256: str | None = None, secret: str | None = None) -> Path:
        """The local path of ``source``, downloading it unless cached or in flight.

        Raises :class:`FetchRefused` when the policy refuses the source (even one cached
        under an older policy), a redirect, the size, the token or the digest.
        """
        _judge(self._policy, source, source)
        path = self.cached_path(source)
        if path.exists():
            size = path.stat().st_size
            on_progress(FetchProgress(phase="cached", bytes_done=size, bytes_total=size))
            if sha256 is not None:
                await self._check_digest(path, sha256, await _cached_digest(path))
            return path
        token = _token(secret)
        download = self._inflight.get(source)
        if download is None:
            download = _Download(asyncio.get_running_loop().create_future())
            self._inflight[source] = download
            download.task = asyncio.create_task(self._download(source, path, download, token))
            self._tasks.add(download.task)
            download.task.add_done_callback(self._tasks.discard)
        download.waiters += 1
        try:
            # Every waiter reports the shared download's progress in its own heartbeats.
            while not download.future.done():
                on_progress(download.progress)
                await asyncio.wait([download.future], timeout=PROGRESS_INTERVAL_S)
        finally:
            download.waiters -= 1
            if download.waiters == 0 and not download.future.done():
                self._abandon(source, download)
        path = download.future.result()
        if sha256 is not None:
            await self._check_digest(path, sha256, await _cached_digest(path))
        return path

    def _abandon(self, source: str, download: _Download) -> None:
        """The last start waiting for ``download`` gave up: stop it. A new fetch of the
        same source starts afresh rather than joining a download being torn down."""
        if self._inflight.get(source) is download:
            del self._inflight[source]
        if download.task is not None:
            download.task.cancel()

    async def _check_digest(self, path: Path, expected: str, actual: str) -> None:
        if actual != expected:
            # Not what the catalog says: no engine may read it, and the next start should
            # download it again rather than trust it.
            path.unlink(missing_ok=True)
            _digest_path(path).unlink(missing_ok=True)
            raise FetchRefused("sha256", expected,
                               f"the file downloaded from the source has SHA-256 {actual}; "
                               "it was removed")

    async def _download(self, source: str, path: Path, download: _Download,
                        token: str | None) -> None:
        # A name of its own: an abandoned download's clean-up must not remove the file
        # of the download that replaced it.
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.part")
        future = download.future
        try:
            self._cache_dir.mkdir(parents=True, exist_ok=True)
            client = self._client or httpx.AsyncClient(timeout=httpx.Timeout(FETCH_TIMEOUT_S))
            try:
                digest = await self._stream_to(client, source, tmp, download, token)
            finally:
                if self._client is None:
                    await client.aclose()
            _digest_path(path).write_text(digest)
            tmp.replace(path)  # only complete files get the final name
            future.set_result(path)
        except asyncio.CancelledError:
            tmp.unlink(missing_ok=True)
            future.cancel()
            raise
        except (httpx.HTTPError, OSError, FetchRefused) as exc:
            tmp.unlink(missing_ok=True)
            future.set_exception(exc)
        finally:
            if self._inflight.get(source) is download:
                del self._inflight[source]

    async def _stream_to(self, client: httpx.AsyncClient, source: str, tmp: Path,
                         download: _Download, token: str | None) -> str:
        """Write ``source`` to ``tmp``, following redirects the policy allows; its SHA-256."""
        limit = self._policy.max_download_bytes
        async with self._open(client, source, token) as resp:
            if resp.is_client_error:
                # The source's own answer that it is not there (or not for us): trying
                # again gives the same answer, so the start fails at once, naming it.
                raise FetchRefused("source", source,
                                   f"could not be fetched: {resp.request.url} answered "
                                   f"{resp.status_code} {resp.reason_phrase}")
            resp.raise_for_status()
            length = resp.headers.get("content-length")
            total = int(length) if length and length.isdigit() else None
            if total is not None and total > limit:
                raise FetchRefused("source", source,
                                   f"the server sends {total} bytes; the limit is {limit} "
                                   "(source_max_download_bytes)")
            # The size is known from here: show it before the first chunk arrives.
            download.progress = FetchProgress(phase="fetching", bytes_total=total)
            hasher = hashlib.sha256()
            done = 0
            samples: tuple[tuple[float, int], ...] = ((time.monotonic(), 0),)
            with tmp.open("wb") as out:
                async for chunk in resp.aiter_bytes(CHUNK_BYTES):
                    done += len(chunk)
                    if done > limit:
                        raise FetchRefused("source", source,
                                           f"the server sent more than {limit} bytes, the "
                                           "limit (source_max_download_bytes)")
                    hasher.update(chunk)
                    out.write(chunk)
                    samples = keep_window(samples, time.monotonic(), done)
                    download.progress = FetchProgress(phase="fetching", bytes_done=done,
                                                      bytes_total=total,
                                                      rate_bytes_per_s=download_rate(samples))
        return hasher.hexdigest()

    @contextlib.asynccontextmanager
    async def _open(self, client: httpx.AsyncClient, source: str, token: str | None,
                    ) -> AsyncIterator[httpx.Response]:
        """The response to GET ``source``, its redirects followed only where the policy
        allows, and the token sent only to the source's own origin."""
        url = httpx.URL(source)
        origin = _origin(url)
        for _ in range(MAX_REDIRECTS + 1):
            headers = ({"Authorization": f"Bearer {token}"}
                       if token is not None and _origin(url) == origin else {})
            resp = await client.send(client.build_request("GET", url, headers=headers),
                                     stream=True, follow_redirects=False)
            if not resp.is_redirect:
                try:
                    yield resp
                finally:
                    await resp.aclose()
                return
            await resp.aclose()
            location = resp.headers.get("location", "")
            url = url.join(location)
            _judge(self._policy, source, str(url))
        raise FetchRefused("source", source, f"more than {MAX_REDIRECTS} redirects")


def _judge(policy: SourcePolicy, source: str, url: str) -> None:
    """Raise :class:`FetchRefused` unless the policy allows ``url`` (the source itself, or
    a redirect of it)."""
    verdict = check_url(policy, url)
    if isinstance(verdict, SourceRefused):
        if url == source:
            raise FetchRefused("source", source, verdict.rule)
        raise FetchRefused("source", source,
                           f"redirected to {url!r}, which this agent refuses: {verdict.rule}")


def _token(secret: str | None) -> str | None:
    """The token a model's ``secret`` names, from this agent's environment."""
    if secret is None:
        return None
    name = secret_env_var(secret)
    token = os.environ.get(name)
    if not token:
        raise FetchRefused("secret", secret, f"${name} is not set on this agent")
    return token


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return url.scheme, url.host, url.port


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


async def _cached_digest(path: Path) -> str:
    """The SHA-256 of a cached file, from beside it or, for a file cached before digests
    were kept, computed once (in a thread: it reads the whole file) and kept."""
    kept = _digest_path(path)
    with contextlib.suppress(FileNotFoundError):
        return kept.read_text().strip()
    digest = await asyncio.to_thread(file_sha256, path)
    kept.write_text(digest)
    return digest


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in chunks. For a local source with a catalog digest, the
    agent checks this before the engine reads the file."""
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()
