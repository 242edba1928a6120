"""A real uvicorn server on a free loopback port, serving ``create_app`` with small upload caps.

The only stand-in is the broker: ``RecordingDispatcher`` records what would be enqueued (tests of the
real dispatcher live with the workers). The job table and blob store are real, in a temp data dir, and
tests reach them through their own ``JobStore``/``BlobStore``, as a worker process would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.main import create_app
from core.errors import UnavailableError
from core.settings import Settings
from core.storage import BlobStore
from core.store import JobStore

MODEL_CAP = 256 << 10
SAMPLES_CAP = 64 << 10
CONFIG_CAP = 4 << 10


class RecordingDispatcher:
    """The broker's test double: records (job_id, queue) pairs; can be told to be down."""

    def __init__(self) -> None:
        self.enqueued: list[tuple[str, str]] = []
        self.priorities: list[int | None] = []
        self.down = False
        self._lock = threading.Lock()

    def enqueue(self, job_id: str, queue: str, priority: int | None = None) -> None:
        if self.down:
            raise UnavailableError("recorder: broker down", code="BROKER_UNAVAILABLE")
        with self._lock:
            self.enqueued.append((job_id, queue))
            self.priorities.append(priority)

    def ping(self) -> None:
        if self.down:
            raise UnavailableError("recorder: broker down", code="BROKER_UNAVAILABLE")

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Live:
    base_url: str
    settings: Settings
    dispatcher: RecordingDispatcher
    store: JobStore
    blobs: BlobStore
    client: httpx.Client

    def tmp_files(self) -> list[Path]:
        return sorted(self.blobs.tmp_dir.iterdir())


class ServerThread:
    """uvicorn.Server in a thread, on a socket we bound (so the port is known before it starts)."""

    def __init__(self, app: object) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 15.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during startup; see the log above")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"uvicorn did not answer /healthz within {timeout} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def make_settings(data_dir: Path, **sections: dict[str, Any]) -> Settings:
    """Settings of a test server: small upload caps in ``data_dir``; ``sections`` add to or override them."""
    api = {
        "max_upload_bytes": MODEL_CAP,
        "max_samples_bytes": SAMPLES_CAP,
        "max_config_bytes": CONFIG_CAP,
        "page_size_max": 50,
        **sections.pop("api", {}),
    }
    # Files of a deleted job go at once: no upload here runs long enough to need the grace period.
    retention = {"blob_grace_seconds": 0, **sections.pop("retention", {})}
    return Settings(storage={"data_dir": data_dir}, api=api, retention=retention, **sections)


@contextlib.contextmanager
def serve(settings: Settings) -> Iterator[Live]:
    """``create_app(settings)`` served by uvicorn on a free loopback port until the block ends."""
    dispatcher = RecordingDispatcher()
    server = ServerThread(create_app(settings, dispatcher=dispatcher))
    try:
        server.start()
        store = JobStore(settings.database_url)
        blobs = BlobStore(settings.storage.blobs_dir)
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
            yield Live(client.base_url.__str__(), settings, dispatcher, store, blobs, client)
        store.close()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The server in open mode (no keys, loopback): every request is tenant ``default``."""
    with serve(make_settings(tmp_path_factory.mktemp("data"))) as server:
        yield server


@pytest.fixture
def api(live: Live) -> Live:
    """The shared server, with the recorder emptied and the broker up."""
    live.dispatcher.enqueued.clear()
    live.dispatcher.priorities.clear()
    live.dispatcher.down = False
    return live
