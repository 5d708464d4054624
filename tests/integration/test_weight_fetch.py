"""Weight fetching: progress in bytes, single flight per source, atomic files."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.fetch import WeightFetcher
from modelkeeper.domain.shards import FetchProgress
from modelkeeper.domain.sources import SourcePolicy

pytestmark = pytest.mark.timeout(30)

BODY = b"g" * (3 << 20)
#: The test server is plain http on loopback, which the default policy refuses.
LOOPBACK = SourcePolicy(schemes=frozenset({"http"}), hosts=("127.0.0.1",))


class Served:
    def __init__(self) -> None:
        self.gets = 0
        self.release = threading.Event()


@pytest.fixture
def server() -> Iterator[tuple[str, Served]]:
    state = Served()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.gets += 1
            self.send_response(200)
            if self.path != "/nolength.gguf":
                self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[: 1 << 20])
            self.wfile.flush()
            # Hold the rest until the test has seen concurrent waiters share this download.
            state.release.wait(10)
            self.wfile.write(BODY[1 << 20:])

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    finally:
        state.release.set()
        httpd.shutdown()


async def test_concurrent_fetches_share_one_download(server: tuple[str, Served],
                                                     tmp_path: Path) -> None:
    base, state = server
    fetcher = WeightFetcher(tmp_path, policy=LOOPBACK)
    seen: list[FetchProgress] = []
    url = f"{base}/model.gguf"
    tasks = [asyncio.create_task(fetcher.fetch(url, seen.append)) for _ in range(3)]
    while not any(p.bytes_done >= 1 << 20 for p in seen):
        await asyncio.sleep(0.02)
    state.release.set()
    paths = await asyncio.gather(*tasks)
    assert state.gets == 1
    assert len(set(paths)) == 1 and paths[0].read_bytes() == BODY
    assert all(p.bytes_total in (None, len(BODY)) for p in seen)
    assert not list(tmp_path.glob("*.part"))
    # A later fetch reuses the file.
    again = await fetcher.fetch(url, seen.append)
    assert again == paths[0] and state.gets == 1


async def test_unknown_size_reports_bytes_without_a_total(server: tuple[str, Served],
                                                          tmp_path: Path) -> None:
    base, state = server
    seen: list[FetchProgress] = []
    fetcher = WeightFetcher(tmp_path, policy=LOOPBACK)
    task = asyncio.create_task(fetcher.fetch(f"{base}/nolength.gguf", seen.append))
    while not any(p.bytes_done > 0 for p in seen):
        await asyncio.sleep(0.02)
    state.release.set()
    await task
    assert all(p.bytes_total is None for p in seen)
