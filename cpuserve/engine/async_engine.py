"""The engine core on its own thread, driven from asyncio: the event loop never waits for a
forward pass, and the engine thread never waits for a tokenizer.

`generate` tokenizes and validates on a worker thread (input processor), hands the request to the
engine thread, which applies adds, aborts and stop-string finishes between steps, and turns each
engine-core output into text on the event loop (output processor). A request whose consumer goes
away (a client that disconnects, a cancelled task) is aborted and its KV blocks freed before the
next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from cpuserve.engine.llm_engine import LLMEngine
from cpuserve.engine.output_processor import RequestState
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.requests import EngineCoreOutput, EngineCoreRequest
from cpuserve.engine.sampling_params import InvalidRequest, SamplingParams
from cpuserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; the process should be restarted."""


class RequestFailed(RuntimeError):
    """This request alone hit a fault (logged by the engine); the engine serves the others."""


class RequestCancelled(RuntimeError):
    """The server is shutting down and stopped this request before it finished."""


@dataclass
class _Add:
    request: EngineCoreRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: concurrent.futures.Future


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | None,
        on_fatal: Callable[[BaseException], None] | None = None,
        factory: Callable[[], LLMEngine] | None = None,
    ) -> None:
        """on_fatal runs on the engine thread after a fatal error (the server uses it to exit).
        With `factory` (and no engine), the engine thread builds the engine first: see load()."""
        self.engine = engine  # type: ignore[assignment]
        self.on_fatal = on_fatal
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        # (the request's add, sequence index, stop string): keyed by the add, not the id, so a stop
        # that arrives after its request ended can never finish a new request reusing the id.
        self._stops: list[tuple[_Add, int, str]] = []
        self._cancel_all: str | None = None
        self._streams: dict[str, _Add] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._loaded: concurrent.futures.Future = concurrent.futures.Future()
        if factory is None:
            self._loaded.set_result(None)
        self._thread = threading.Thread(target=self._load_and_run, args=(factory,), name="cpuserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls, factory: Callable[[], LLMEngine], on_fatal: Callable[[BaseException], None] | None = None
    ) -> AsyncEngine:
        """Build the engine on the engine thread (loading's errors raised here), so that thread is the
        only one that ever runs torch's parallel regions; then the caller's thread, and threads it
        starts later, run torch single-threaded. libgomp gives every thread that opens a parallel
        region its own pool, and once its threads outnumber the CPUs it stops spinning between
        regions: each region then waits for a futex wake-up. Measured on 2 cores (docs/benchmarks.md,
        "Serving under load"): a 1-row linear 74 us on the thread that opened the first pool, 256 us on
        a second; SmolLM2 through the server 24-74 tok/s before, 50-97 after (prompt-heavy)."""
        self = cls(None, on_fatal, factory)
        self._loaded.result()
        import torch

        torch.set_num_threads(1)  # this thread's OpenMP setting, and what new threads start with
        return self

    def _load_and_run(self, factory: Callable[[], LLMEngine] | None) -> None:
        if factory is not None:
            import torch

            # Fix this thread's OpenMP setting now, from the process's (load() sets the caller's to 1
            # once loading is done; torch reads the global on a thread's first parallel call).
            torch.get_num_threads()
            try:
                self.engine = factory()
            except BaseException as exc:
                self._loaded.set_exception(exc)
                return
            self._loaded.set_result(None)
        self._run()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they change; InvalidRequest is raised before the first."""
        if not self.alive:
            raise EngineDeadError("the engine is not running") from self.error
        loop = asyncio.get_running_loop()
        if isinstance(prompt, str) or params.structured_outputs is not None:
            # tokenizing or compiling a grammar may take milliseconds: not on the event loop
            request = await loop.run_in_executor(None, self.engine.inputs.process, request_id, prompt, params)
        else:
            request = self.engine.inputs.process(request_id, prompt, params)
        add = _Add(request, loop, asyncio.Queue(), concurrent.futures.Future())
        state = RequestState(self.engine.tokenizer, request)
        with self._cond:
            self._adds.append(add)
            self._cond.notify()
        try:
            await asyncio.wrap_future(add.accepted)
        except asyncio.CancelledError:  # gone before the engine took it: queued after the add, so applied after
            self.abort(request_id)
            raise
        finished = False
        try:
            while True:
                item = await add.queue.get()
                if isinstance(item, RequestFailed | RequestCancelled):
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine stopped") from item
                if item.error is not None:
                    finished = True
                    raise RequestFailed(item.error)
                out = self._process(add, state, item)
                if out is None:
                    continue
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _process(self, add: _Add, state: RequestState, item: EngineCoreOutput) -> RequestOutput | None:
        """Text for one engine-core output; stop strings found are sent to the engine thread. A
        fault here fails this request alone (RequestFailed; the engine aborts it)."""
        request_id = state.request.request_id
        try:
            out, stops = state.process(item)
        except Exception as exc:
            log.error("request %s failed (the others go on)", request_id, exc_info=exc)
            self.abort(request_id)
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
        if stops:
            with self._cond:
                self._stops.extend((add, index, stop) for index, stop in stops)
                self._cond.notify()
        return out

    def abort(self, request_id: str) -> None:
        """Abort before the next step (idempotent; unknown or finished ids are ignored)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def cancel_all(self, reason: str) -> None:
        """Stop every running and waiting request before the next step; each stream gets
        RequestCancelled(reason). Used when a graceful shutdown runs out of time."""
        with self._cond:
            self._cancel_all = reason
            self._cond.notify()

    # ---- what the server may know of the engine (it never reaches inside) ------------------------

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        """The model's tokenizer (thread-safe for encode/decode; the server calls it off the event loop)."""
        return self.engine.tokenizer

    @property
    def hidden_size(self) -> int:
        """The width of the model's hidden states (of its embeddings)."""
        return self.engine.model.spec.hidden_size

    @property
    def pooling(self):  # type: ignore[no-untyped-def]
        """How embedding requests pool: the model's sentence-transformers config, or mean + normalize."""
        return self.engine.pooling

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (read without a lock: each number is a plain read)."""
        return self.engine.stats_snapshot()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def _deliver(self, add: _Add, item: EngineCoreOutput | BaseException) -> None:
        add.loop.call_soon_threadsafe(add.queue.put_nowait, item)

    def _run(self) -> None:
        engine = self.engine.core
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._stopping or self._cancel_all or engine.has_unfinished()):
                    self._cond.wait()
                if self._stopping:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                stops, self._stops = self._stops, []
                cancel, self._cancel_all = self._cancel_all, None
            for add in adds:
                request_id = add.request.request_id
                if not add.accepted.set_running_or_notify_cancel():
                    continue  # its caller went away before the engine took it
                if request_id in self._streams:
                    add.accepted.set_exception(InvalidRequest("request_id", f"{request_id!r} is already running"))
                    continue
                try:
                    engine.add_request(add.request)
                except Exception as exc:  # rejected: the caller gets the error, nothing is queued
                    add.accepted.set_exception(exc)
                    continue
                self._streams[request_id] = add
                add.accepted.set_result(None)
            for add, index, stop in stops:
                request_id = add.request.request_id
                if self._streams.get(request_id) is not add:
                    continue  # it ended (or was aborted) before the stop arrived
                engine.finish_by_stop_string(request_id, index, stop)
                if not engine.has_request(request_id):
                    self._streams.pop(request_id, None)
            for request_id in aborts:
                if engine.abort(request_id):
                    log.debug("aborted %s", request_id)
                self._streams.pop(request_id, None)
            if cancel is not None:
                for request_id, add in list(self._streams.items()):
                    engine.abort(request_id)
                    self._deliver(add, RequestCancelled(cancel))
                self._streams.clear()
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine step failed; the engine stops")
                self.error = exc
                for add in self._streams.values():
                    self._deliver(add, exc)
                if self.on_fatal is not None:
                    self.on_fatal(exc)
                return
            for out in outputs:
                add = self._streams.get(out.request_id)
                if add is not None:
                    self._deliver(add, out)
                    if not engine.has_request(out.request_id):  # finished, or failed alone
                        del self._streams[out.request_id]
