"""A blocking facade over ``Client`` for code without an event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from redbatch import protocol
from redbatch.errors import DeadlineExceeded, RedbatchError
from redbatch.producer.client import Client
from redbatch.producer.streams import sync_stream

T = TypeVar("T")
MARGIN_S = 5.0


class SyncClient:
    """``predict``, ``submit`` (a ``concurrent.futures.Future``), ``predict_many`` and
    ``submit_many``, with ``Client``'s keywords (``reply=True`` among them), run on a
    private event loop in a daemon thread.  Takes ``Client``'s arguments."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        self._lock = threading.Lock()  # a call scheduled, or close begun: one at a time
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="redbatch-sync-client")
        self._thread.start()
        try:
            self._client = self._call(self._make(url, kwargs), 30.0)
            self._call(self._client.start(), 30.0)
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(url: str | None, kwargs: dict[str, Any]) -> Client:
        return Client(url, **kwargs)

    def _schedule(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """``coro`` on the client's loop; ``RedbatchError`` once ``close`` has begun."""
        with self._lock:
            if self._closed:
                coro.close()
                raise RedbatchError("the client is closed")
            return asyncio.run_coroutine_threadsafe(self._settled(coro), self._loop)

    async def _settled(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``, whose cancellation by ``close`` (a call still starting, or still
        waiting, when the loop's tasks are cancelled) is ``RedbatchError`` for its
        caller, as the client's own close gives the calls it ends."""
        try:
            return await coro
        except asyncio.CancelledError:
            if not self._closed:
                raise  # (its caller cancelled it)
            raise RedbatchError("the client closed before the reply arrived") from None

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = self._schedule(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise DeadlineExceeded(f"no answer within {timeout_s:.1f} s") from exc

    def _budget(self, timeout_s: float | None, deadline_ms: int | None = None) -> float:
        """How long a blocking call waits: the request's own time (its ``deadline_ms``
        when given, else its timeout), and a margin."""
        if deadline_ms is not None:
            return max(0.0, (deadline_ms - protocol.now_ms()) / 1000) + MARGIN_S
        return (self._client.default_timeout_s if timeout_s is None else timeout_s) + MARGIN_S

    def predict(self, model: str, inputs: Any, timeout_s: float | None = None, *,
                reply: bool = False, **kwargs: Any) -> Any:
        """``Client.predict``, blocking; takes its keywords."""
        return self._call(self._client.predict(model, inputs, timeout_s, reply=reply,
                                               **kwargs),
                          self._budget(timeout_s, kwargs.get("deadline_ms")))

    def submit(self, model: str, inputs: Any, timeout_s: float | None = None, *,
               reply: bool = False, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Enqueue and return at once; the future resolves to the output."""
        return self._schedule(
            self._client.predict(model, inputs, timeout_s, reply=reply, **kwargs))

    def submit_many(self, model: str, inputs: Sequence[Any], timeout_s: float | None = None,
                    *, reply: bool = False, **kwargs: Any
                    ) -> list[concurrent.futures.Future[Any]]:
        """``Client.submit_many``: enqueued once this returns; a future per input."""
        budget_s = self._budget(timeout_s, kwargs.get("deadline_ms"))
        coro = self._submit_many(model, inputs, timeout_s, reply=reply, **kwargs)
        return self._call(coro, budget_s)

    async def _submit_many(self, model: str, inputs: Sequence[Any], timeout_s: float | None,
                           **kwargs: Any) -> list[concurrent.futures.Future[Any]]:
        futures = await self._client.submit_many(model, inputs, timeout_s, **kwargs)
        return [_chained(f, self._loop) for f in futures]

    def predict_many(self, model: str, inputs: Sequence[Any], timeout_s: float | None = None,
                     *, reply: bool = False, return_exceptions: bool = False,
                     priority: int | None = None, version: str | None = None) -> list[Any]:
        coro = self._client.predict_many(model, inputs, timeout_s, reply=reply,
                                         return_exceptions=return_exceptions,
                                         priority=priority, version=version)
        return self._call(coro, self._budget(timeout_s))

    def stream(self, model: str, inputs: Any, timeout_s: float | None = None,
               **kwargs: Any) -> Iterator[Any]:
        """``Client.stream`` as a blocking iterator; closing it early cancels it."""
        stream = self._client.stream(model, inputs, timeout_s, **kwargs)
        return sync_stream(self._call, stream, self._budget(timeout_s,
                                                            kwargs.get("deadline_ms")))

    def configure(self, model: str, *, reset: bool = False, **values: Any) -> dict[str, Any]:
        """``Client.configure`` (an admin call: a model's live knobs), blocking."""
        return self._call(self._client.configure(model, reset=reset, **values), 30.0)

    def versions(self, model: str, **changes: Any) -> dict[str, Any]:
        """``Client.versions`` (an admin call: a model's versions and split), blocking."""
        return self._call(self._client.versions(model, **changes), 30.0)

    def close(self) -> None:
        """Close the client (its waiting calls fail), once; calls made from other
        threads after it began raise ``RedbatchError``, and none is left unsettled."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(10.0)
        except concurrent.futures.TimeoutError:
            pass  # (what it left running is cancelled below)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Cancel what still runs on the loop (its callers' futures then settle), then
        stop and close it."""
        if self._loop.is_running():
            with contextlib.suppress(concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(), self._loop).result(10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def _cancel_the_rest() -> None:
    """Cancel the loop's other tasks and let them end (as ``asyncio.run`` does)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)


def _chained(future: asyncio.Future[T], loop: asyncio.AbstractEventLoop
             ) -> concurrent.futures.Future[T]:
    """A thread-safe future that settles as ``future`` does (on ``loop``), and whose
    cancelling cancels it."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.add_done_callback(lambda done: _copy(done, out))
    out.add_done_callback(lambda o: _cancel_from(o, future, loop))
    return out


def _cancel_from(out: concurrent.futures.Future[T], future: asyncio.Future[T],
                 loop: asyncio.AbstractEventLoop) -> None:
    if out.cancelled() and not loop.is_closed():
        loop.call_soon_threadsafe(future.cancel)


def _copy(done: asyncio.Future[T], out: concurrent.futures.Future[T]) -> None:
    if done.cancelled():
        out.cancel()
        return
    try:
        if (exc := done.exception()) is not None:
            out.set_exception(exc)
        else:
            out.set_result(done.result())
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile, by its caller
        pass
