"""SIGTERM's handler sets the drain state before anything that can fail: a signal that lands while
the main thread writes a log line to stderr made the handler's own log write a reentrant call that
raised out of it, so the server never drained nor exited (seen once in tests/test_wheel.py)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
import uvicorn

from cpuserve.server import shutdown


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the log thread's own failure
def test_a_failing_log_write_in_the_handler_cannot_stop_the_drain(monkeypatch):
    def reentrant(*args, **kwargs):
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    monkeypatch.setattr(shutdown.log, "info", reentrant)
    cancelled = []
    engine = SimpleNamespace(num_requests=1, cancel_all=lambda why: cancelled.append(why))
    api = SimpleNamespace(engine=engine, draining=False)
    server = shutdown.HttpServer(uvicorn.Config(app=None), api, timeout=0.01)
    server.handle_exit(signal.SIGTERM, None)  # must not raise, whatever the logging does
    assert server.should_exit and api.draining
    server._timer.join(2)
    assert cancelled == ["the server is shutting down"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_drain_is_logged(sig, caplog):
    engine = SimpleNamespace(num_requests=3, cancel_all=lambda why: None)
    server = shutdown.HttpServer(uvicorn.Config(app=None), SimpleNamespace(engine=engine, draining=False), 5)
    with caplog.at_level("INFO", logger="cpuserve"):
        server.handle_exit(sig, None)
        for _ in range(100):
            if caplog.records:
                break
            time.sleep(0.01)
    server._timer.cancel()
    assert [r.getMessage() for r in caplog.records] == [
        f"{signal.Signals(sig).name}: draining; 3 request(s) in flight get up to 5 s to finish"
    ]
