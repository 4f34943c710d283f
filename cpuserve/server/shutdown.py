"""The HTTP server's life cycle: graceful drain on SIGTERM/SIGINT, non-zero exit on a fatal engine error.

On the first signal the listening socket closes (uvicorn), new requests on open connections get
503, running requests may finish for `timeout` seconds, then the engine stops the rest and each gets
a proper error (an SSE error event + [DONE], or a 503 body) before the process exits 0. A second
SIGINT forces the exit. A fatal engine error makes the process exit 1 so a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("cpuserve")


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api: Any, timeout: float) -> None:
        config.timeout_graceful_shutdown = timeout + 10  # backstop: connections that never close
        super().__init__(config)
        self.api, self.timeout = api, timeout
        self.fatal: BaseException | None = None
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, except that the signal is not raised again afterwards: a drained
        shutdown is a clean exit (status 0), not death by SIGTERM."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._timer is not None:
                self._timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        engine = self.api.engine
        self.api.draining = True
        self.should_exit = True
        self._timer = threading.Timer(self.timeout, engine.cancel_all, args=("the server is shutting down",))
        self._timer.daemon = True
        self._timer.start()
        # Said from another thread, never from this handler: the signal may have interrupted a write to
        # the same stream (an access-log line), and a write from here is then a reentrant call that
        # raises out of the handler (seen: the drain flags never set, the server never exited).
        threading.Thread(
            target=log.info,
            args=(
                "%s: draining; %d request(s) in flight get up to %.0f s to finish",
                signal.Signals(sig).name,
                engine.num_requests,
                self.timeout,
            ),
            daemon=True,
        ).start()

    def stop_for_fatal_error(self, exc: BaseException) -> None:
        """Called on the engine thread: requests were already failed; stop serving and exit 1."""
        self.fatal = exc
        self.api.draining = True
        self.should_exit = True
