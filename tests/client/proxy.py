"""A TCP proxy in front of a gateway that cuts connections at random points.

Each connection it accepts goes to the gateway; of the first ``cuts`` ones,
the answer is forwarded for a random number of bytes, then both sides are
aborted (an RST, no clean end), the way a flaky network or a restarted load
balancer drops a stream. A ``POST`` (a turn being started) is cut only after
its response headers went through, unless ``posts_before_headers``: then the
engine has the request (and may have started the turn) while the client gets
nothing, and must send it again with its Idempotency-Key (the SDK's
``Resumer.lost``). It runs its own event loop in a thread, so blocking and
asyncio clients can both use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from types import TracebackType

from tests.processes import free_port

_HEADERS_END = b"\r\n\r\n"


class CuttingProxy:
    def __init__(
        self,
        upstream_port: int,
        *,
        cuts: int,
        max_bytes: int = 3000,
        seed: int = 0,
        posts_before_headers: bool = False,
    ) -> None:
        self._upstream_port = upstream_port
        self._posts_before_headers = posts_before_headers
        self._rng = random.Random(seed)
        self._max_bytes = max_bytes
        self.cuts_left = cuts
        self.cuts_made = 0
        self.connections = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> CuttingProxy:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        budget: int | None = None
        if self.cuts_left > 0:
            self.cuts_left -= 1
            budget = self._rng.randint(1, self._max_bytes)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            client_w.transport.abort()
            return
        first = await client_r.read(65536)
        up_w.write(first)
        posting = first.startswith(b"POST")

        async def upward() -> None:
            while data := await client_r.read(65536):
                up_w.write(data)
                await up_w.drain()

        async def downward() -> None:
            nonlocal budget
            head = b""
            headers_done = not posting
            while data := await up_r.read(65536):
                if budget is not None and posting and self._posts_before_headers:
                    self.cuts_made += 1
                    return  # the engine answered: the client never hears it
                if budget is not None:
                    if not headers_done:
                        head += data
                        end = head.find(_HEADERS_END)
                        if end < 0:
                            client_w.write(data)
                            continue
                        headers_done = True
                        # Count the bytes after the headers only.
                        after = len(head) - end - len(_HEADERS_END)
                        client_w.write(data[: len(data) - after])
                        data = data[len(data) - after :]
                    if len(data) >= budget:
                        client_w.write(data[:budget])
                        await client_w.drain()
                        self.cuts_made += 1
                        return  # the finally below aborts both sides
                    budget -= len(data)
                client_w.write(data)
                await client_w.drain()

        up = asyncio.ensure_future(upward())
        try:
            await downward()
        except (ConnectionError, OSError):
            pass
        finally:
            up.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await up
            client_w.transport.abort()
            up_w.transport.abort()
