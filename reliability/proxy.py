"""A fault proxy in front of a real store's server (moto's S3, fake-gcs-server): every
request passes through it to the server, and it answers some as a store shedding load
does, on 127.0.0.1 only.

    proxy = FaultProxy(upstream_url, Faults(busy=0.1, resets=0.1, bytes_per_s=2e6), seed=0)
    env = s3.point_at(proxy.url)          # the clients talk to the proxy
    proxy.outage(8)                       # the next 8 requests answered 503 (a store down)
    proxy.counts()                        # requests, busy, resets, outage answers
    proxy.close()

The faults: `busy`, a share of requests answered 503 at once (S3's `SlowDown`, GCS's
`backendError`; a HEAD with no body, as a server sends it); `resets`, a share of
connections closed with no answer; `bytes_per_s`, the request and response bodies paced
to that rate (a throttled or far store: slow, never stalled); `outage(n)`, the next `n`
requests answered 503 whatever the shares, counted in requests so that a test waits on
events, not on time. Decisions are drawn from one seeded generator, in the order
requests arrive. Response headers that name the server (a resumable upload's Location)
are rewritten to name the proxy, so that every request goes through it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from reliability import launch

_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "te",
    "upgrade",
    "expect",
}
_S3_BUSY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_GCS_BUSY = (
    b'{"error": {"code": 503, "message": "We encountered an internal error. Please try '
    b'again.", "errors": [{"reason": "backendError"}]}}'
)
_PACE_BYTES = 16 * 1024  # a paced body moves this much at a time


@dataclasses.dataclass(frozen=True)
class Faults:
    """What the proxy does to the requests it passes (see the module's docstring)."""

    busy: float = 0.0
    resets: float = 0.0
    bytes_per_s: float | None = None


class FaultProxy:
    """The proxy, serving in a thread of its own from construction to `close()`."""

    def __init__(self, upstream: str, faults: Faults = Faults(), *, seed: int = 0):
        self.upstream = upstream.rstrip("/")
        self.url = f"http://127.0.0.1:{launch.free_port()}"
        self._faults = faults
        self._random = random.Random(seed)
        self._outage = self._outage_of = 0
        self._outage_first = self._outage_last = 0.0
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise TimeoutError(f"the fault proxy in front of {upstream} did not start in 30 s")

    def set(self, faults: Faults) -> None:
        """The faults of the requests from now on."""
        with self._lock:
            self._faults = faults

    def outage(self, requests: int) -> None:
        """The next `requests` requests are answered 503, as a store that is down."""
        with self._lock:
            self._outage = self._outage_of = requests

    def counts(self) -> dict[str, int]:
        """Requests passed on (`passed`), answered busy (`busy`), reset (`reset`), answered
        during an outage (`outage`), and bytes each way (`sent`, `received`)."""
        with self._lock:
            return dict(self._counts)

    def outage_s(self) -> float:
        """How long the last outage lasted: from its first answer to its last."""
        with self._lock:
            return self._outage_last - self._outage_first

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- serving

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=2**31)
        app.router.add_route("*", "/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = int(self.url.rpartition(":")[2])
        await web.TCPSite(runner, "127.0.0.1", port).start()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
        async with aiohttp.ClientSession(auto_decompress=False, timeout=timeout) as session:
            self._session = session
            self._started.set()
            await self._stop.wait()
        await runner.cleanup()

    def _decide(self) -> str:
        with self._lock:
            if self._outage > 0:
                now = time.monotonic()
                if self._outage == self._outage_of:
                    self._outage_first = now
                self._outage_last = now
                self._outage -= 1
                return "outage"
            draw = self._random.random()
            if draw < self._faults.busy:
                return "busy"
            if draw < self._faults.busy + self._faults.resets:
                return "reset"
            return "passed"

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        fate = self._decide()
        self._count(fate)
        if fate == "reset":
            assert request.transport is not None
            request.transport.abort()  # (no answer: the client's connection is reset)
            return web.Response()
        if fate in ("busy", "outage"):
            await request.read()
            return self._busy(request)
        body = await self._paced_read(request)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["Host"] = request.headers.get("Host", "")
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"),
        ) as answer:
            data = await answer.read()
            out = web.StreamResponse(status=answer.status, reason=answer.reason)
            for key, value in answer.headers.items():
                if key.lower() not in _HOP:
                    out.headers.add(key, value.replace(self.upstream, self.url))
            if request.method != "HEAD":
                out.content_length = len(data)
            else:
                length = answer.headers.get("Content-Length")
                if length is not None:
                    out.headers["Content-Length"] = length
            try:
                await out.prepare(request)
                await self._paced_write(out, data)
                await out.write_eof()
            except ConnectionResetError:  # the client gave up on this answer: its own say
                self._count("abandoned")
            return out

    def _busy(self, request: web.Request) -> web.Response:
        s3 = "/storage/v1/" not in request.path and "/upload/" not in request.path
        body = b"" if request.method == "HEAD" else (_S3_BUSY if s3 else _GCS_BUSY)
        kind = "application/xml" if s3 else "application/json"
        return web.Response(status=503, body=body, content_type=kind, headers={"Retry-After": "1"})

    async def _paced(self, n: int) -> None:
        rate = self._faults.bytes_per_s
        if rate:
            await asyncio.sleep(n / rate)

    async def _paced_read(self, request: web.Request) -> bytes:
        chunks = []
        async for chunk in request.content.iter_chunked(_PACE_BYTES):
            chunks.append(chunk)
            await self._paced(len(chunk))
        body = b"".join(chunks)
        self._count("received", len(body))
        return body

    async def _paced_write(self, out: web.StreamResponse, data: bytes) -> None:
        for start in range(0, len(data), _PACE_BYTES):
            chunk = data[start : start + _PACE_BYTES]
            await out.write(chunk)
            await self._paced(len(chunk))
        self._count("sent", len(data))
