"""The engine as a request loop: one thread owns the :class:`~.engine.Engine` (the model,
the KV cache, the scheduler); clients in any thread submit and cancel requests and
read their events.

    loop = EngineLoop(engine)
    handle = loop.submit([request_a, request_b])   # admitted at the next step
    for request, event in handle:                  # events as the loop produces them
        ...
    loop.cancel(handle.requests)                   # blocks freed when this returns
    loop.close()

Each step the loop thread first takes what clients queued (new requests, then
cancellations, in the order they were made), then runs one engine step and hands
each event to its request's client. Between steps nothing of the engine is touched
by anyone else, so there are no locks in the engine itself. A failing model step
ends every request then in the engine with the exception (raised in each client);
the loop keeps serving later requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable, Iterator, Sequence

from atbcore.errors import AtbError

from .engine import Engine
from .outputs import TokenEvent
from .request import Request

__all__ = ["EngineLoop", "RequestHandle", "AsyncSink", "EngineClosedError", "finish_pending"]

log = logging.getLogger("atb.serving")

_DONE = object()  # the sink's end marker (after a request's last event)


class EngineClosedError(AtbError):
    """A request was submitted to, or was running in, an engine loop that closed."""

    def __init__(self, op: str = "LLM") -> None:
        super().__init__(op, "engine loop", "a running engine loop (the LLM was closed?)",
                         "a closed one")


class AsyncSink:
    """A sink for an asyncio client: the engine thread's ``put`` hands each item to
    ``asyncio_loop`` (thread-safe), where :meth:`RequestHandle.aget` awaits it."""

    def __init__(self, asyncio_loop: asyncio.AbstractEventLoop) -> None:
        self.loop = asyncio_loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed: nobody is listening any more
            pass

    async def get(self) -> object:
        return await self.queue.get()


class RequestHandle:
    """What :meth:`EngineLoop.submit` returns: iterate it (or await :meth:`aget` with
    an :class:`AsyncSink`) for ``(request, event)`` pairs of its requests until all
    have finished (an engine failure is raised here)."""

    def __init__(self, requests: Sequence[Request], sink: object | None = None) -> None:
        self.requests = list(requests)
        self.sink = sink if sink is not None else queue.SimpleQueue()
        self._open = len(self.requests)

    @property
    def finished(self) -> bool:
        return self._open == 0

    def _take(self, item: object) -> tuple[Request, TokenEvent] | None:
        if item is _DONE:
            self._open -= 1
            return None
        if isinstance(item, BaseException):
            self._open = 0
            raise item
        return item  # type: ignore[return-value]

    def get(self, timeout: float | None = None) -> tuple[Request, TokenEvent] | None:
        """The next ``(request, event)``; None once every request has finished;
        raises ``queue.Empty`` after ``timeout`` seconds without one."""
        while self._open:
            got = self._take(self.sink.get(timeout=timeout))
            if got is not None:
                return got
        return None

    async def aget(self) -> tuple[Request, TokenEvent] | None:
        """:meth:`get` for a handle made with an :class:`AsyncSink`."""
        while self._open:
            got = self._take(await self.sink.get())
            if got is not None:
                return got
        return None

    def __iter__(self) -> Iterator[tuple[Request, TokenEvent]]:
        while (item := self.get()) is not None:
            yield item


class EngineLoop:
    """Owns ``engine`` on a daemon thread (started at the first submit); see the module
    docstring. ``on_event(request, event)`` (optional) sees every event in the loop
    thread, before the client does."""

    def __init__(self, engine: Engine,
                 on_event: Callable[[Request, TokenEvent], None] | None = None) -> None:
        self.engine = engine
        self.on_event = on_event
        self._cv = threading.Condition()
        self._adds: list[Sequence[Request]] = []
        self._cancels: list[tuple[list[Request], threading.Event]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.num_waiting = self.num_running = 0  # as of the last step, for metrics

    # ------------------------------------------------------------------ clients
    def submit(self, requests: Sequence[Request], sink: object | None = None) -> RequestHandle:
        """Queue ``requests`` together (they reach the engine in the same step, in
        order); their events arrive on the returned handle (through ``sink``: a
        ``queue.SimpleQueue`` by default, an :class:`AsyncSink` for asyncio)."""
        handle = RequestHandle(requests, sink)
        for r in handle.requests:
            r.sink = handle.sink
        with self._cv:
            if self._closed:
                raise EngineClosedError()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="atb-engine", daemon=True)
                self._thread.start()
            self._adds.append(handle.requests)
            self._cv.notify()
        return handle

    def cancel(self, requests: Sequence[Request], wait: bool = True) -> None:
        """Take ``requests`` out of the engine (finished ones are left alone); with
        ``wait``, return once their KV blocks are free. Their handle ends."""
        done = threading.Event()
        with self._cv:
            if self._closed or self._thread is None:
                return
            self._cancels.append((list(requests), done))
            self._cv.notify()
        if wait and threading.current_thread() is not self._thread:
            done.wait()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop thread; requests still in the engine end with
        :class:`EngineClosedError` and their blocks are freed."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._serve()
        finally:  # closed, or the thread is dying: nobody may be left waiting
            with self._cv:
                self._closed = True
                adds, self._adds = self._adds, []
                cancels, self._cancels = self._cancels, []
            for reqs in adds:
                for r in reqs:
                    r.sink.put(EngineClosedError())
            for _, done in cancels:
                done.set()
            self._end_all(EngineClosedError())

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._adds or self._cancels or engine.has_work or self._closed):
                    self._cv.wait()
                adds, self._adds = self._adds, []
                cancels, self._cancels = self._cancels, []
                closed = self._closed
            for reqs in adds:
                engine.add(reqs)
            for reqs, done in cancels:
                for r in reqs:
                    if engine.abort(r):
                        r.sink.put(_DONE)
                done.set()
            self.num_waiting, self.num_running = len(engine.waiting), len(engine.running)
            if closed:
                return
            if not engine.has_work:
                continue
            try:
                events = engine.step()
            except Exception as e:  # the model failed: every request in flight ends with it
                log.exception("atb engine step failed; its requests end with the error")
                self._end_all(e)
                continue
            self.num_waiting, self.num_running = len(engine.waiting), len(engine.running)
            for r, ev in events:
                if self.on_event is not None:
                    self.on_event(r, ev)
                r.sink.put((r, ev))
                if ev.finished:
                    r.sink.put(_DONE)

    def _end_all(self, error: BaseException) -> None:
        engine = self.engine
        for r in list(engine.running) + list(engine.waiting):
            engine.abort(r)
            r.sink.put(error)
        self.num_waiting = self.num_running = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._thread else "idle")
        return f"EngineLoop({state}, waiting={self.num_waiting}, running={self.num_running})"


def finish_pending(loop: EngineLoop, handles: Sequence[RequestHandle], wait: bool = True) -> None:
    """Cancel whatever of ``handles`` is still running (a consumer that stopped early);
    with ``wait``, return once their blocks are free."""
    pending = [r for h in handles if not h.finished for r in h.requests
               if r.finish_reason is None]
    if pending:
        loop.cancel(pending, wait=wait)
