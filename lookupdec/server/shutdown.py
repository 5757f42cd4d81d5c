"""``serve``'s uvicorn server, which drains the app (``app.Drain``) on SIGTERM or Ctrl+C before
uvicorn's own shutdown starts.

uvicorn alone closes the listening socket at once, gives the connections
``timeout_graceful_shutdown`` seconds, then cancels what still runs: a queued or non-streaming
client got uvicorn's plain-text 500, a stream was cut mid-body, the log held a CancelledError
traceback per request, and SIGTERM, raised again once served, ended the process by the signal.
Here the socket stays open through the drain, so that a new request gets the app's 503, and
uvicorn's shutdown only starts once every admitted request is answered: it has nothing left to
cancel.
"""
from __future__ import annotations

import asyncio
import signal
import sys

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server. The first SIGTERM or SIGINT begins the drain: new requests get a 503,
    those in flight get ``drain.grace`` seconds, then those left end with a 503
    (``Drain.abort``), and uvicorn's shutdown follows. A second signal ends the grace period at
    once; a third exits at once (uvicorn's force exit, nothing waited for). A SIGTERM is not
    raised again once served, so the process exits with status 0; a Ctrl+C still ends as a
    KeyboardInterrupt (status 130), as with uvicorn."""

    def __init__(self, config: uvicorn.Config, drain) -> None:  # drain: app.Drain (app imports this module)
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drainer: asyncio.Task | None = None
        self._hurry = asyncio.Event()  # a second signal: the grace period ends now
        self._signals = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()  # (before uvicorn installs the signal handlers)
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (Python runs it on the main thread, which runs the loop, between
        two bytecodes: the loop is reached through ``call_soon_threadsafe`` only)."""
        if sig == signal.SIGINT:  # raised again by uvicorn once served
            getattr(self, "_captured_signals", []).append(sig)
        self._signals += 1
        if self._loop is None or self._signals > 2:
            self.force_exit = self._signals > 2
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._drainer is None:
            self._drainer = self._loop.create_task(self._drain())
        else:
            self._hurry.set()

    async def _drain(self) -> None:
        drain = self.drain
        try:
            drain.begin()
            if drain.active:
                print(f"lookupdec: shutting down: {drain.active} request(s) in flight get up to {drain.grace:g} s "
                      "to finish (--grace); new requests get a 503", file=sys.stderr, flush=True)
            if not await self._idle_within(drain.grace):
                ended = drain.abort()
                print(f"lookupdec: shutdown grace period over: {ended} request(s) still in flight end with a 503",
                      file=sys.stderr, flush=True)
        finally:  # uvicorn's shutdown: it waits for the answers still being written
            self.should_exit = True

    async def _idle_within(self, seconds: float) -> bool:
        """Whether every admitted request is answered within ``seconds`` (or before a second signal)."""
        waits = [asyncio.ensure_future(self.drain.wait_idle()), asyncio.ensure_future(self._hurry.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return not self.drain.active
