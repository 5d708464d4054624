"""Fetching model weights to the node, once per source however many shards ask."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from modelkeeper.domain.shards import FetchProgress

ProgressCallback = Callable[[FetchProgress], None]


def is_remote(source: str) -> bool:
    """True for sources the agent must download (http or https URLs)."""
    return urlparse(source).scheme in ("http", "https")


class WeightFetcher:
    """Downloads weights into a cache folder; concurrent fetches of one source share one
    download (single flight), and later fetches reuse the file."""

    def __init__(self, cache_dir: Path, client: httpx.AsyncClient | None = None) -> None:
        self._cache_dir = cache_dir
        self._client = client
        self._inflight: dict[str, asyncio.Future[Path]] = {}
        self._progress: dict[str, FetchProgress] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # keeps running downloads referenced

    def cached_path(self, source: str) -> Path:
        """Where ``source`` lands: a hash keeps names unique, the suffix keeps the format."""
        name = Path(urlparse(source).path).name or "weights"
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        return self._cache_dir / f"{digest}-{name}"

    async def fetch(self, source: str, on_progress: ProgressCallback) -> Path:
        """The local path of ``source``, downloading it unless cached or in flight."""
        path = self.cached_path(source)
        if path.exists():
            on_progress(FetchProgress(phase="cached", bytes_done=path.stat().st_size,
                                      bytes_total=path.stat().st_size))
            return path
        future = self._inflight.get(source)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._inflight[source] = future
            task = asyncio.create_task(self._download(source, path, future))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # Every waiter reports the shared download's progress in its own heartbeats.
        while not future.done():
            on_progress(self._progress.get(source, FetchProgress(phase="fetching")))
            await asyncio.wait([future], timeout=0.5)
        return future.result()

    async def _download(self, source: str, path: Path, future: asyncio.Future[Path]) -> None:
        tmp = path.with_suffix(path.suffix + ".part")
        try:
            self._cache_dir.mkdir(parents=True, exist_ok=True)
            client = self._client or httpx.AsyncClient(timeout=httpx.Timeout(30.0))
            try:
                async with client.stream("GET", source, follow_redirects=True) as resp:
                    resp.raise_for_status()
                    length = resp.headers.get("content-length")
                    total = int(length) if length and length.isdigit() else None
                    done = 0
                    with tmp.open("wb") as out:
                        async for chunk in resp.aiter_bytes(1 << 20):
                            out.write(chunk)
                            done += len(chunk)
                            self._progress[source] = FetchProgress(
                                phase="fetching", bytes_done=done, bytes_total=total)
                tmp.replace(path)  # only complete files get the final name
            finally:
                if self._client is None:
                    await client.aclose()
            future.set_result(path)
        except (httpx.HTTPError, OSError) as exc:
            tmp.unlink(missing_ok=True)
            future.set_exception(exc)
        finally:
            self._inflight.pop(source, None)
            self._progress.pop(source, None)
