"""A blocking facade over ``Client`` for code without an event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from redbatch.errors import DeadlineExceeded
from redbatch.producer.client import Client

T = TypeVar("T")
MARGIN_S = 5.0


class SyncClient:
    """``predict``, ``submit`` (a ``concurrent.futures.Future``) and ``predict_many``,
    run on a private event loop in a daemon thread.  Takes ``Client``'s arguments."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
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

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise DeadlineExceeded(f"no answer within {timeout_s:.1f} s") from exc

    def _budget(self, timeout_s: float | None) -> float:
        return (self._client.default_timeout_s if timeout_s is None else timeout_s) + MARGIN_S

    def predict(self, model: str, inputs: Any, timeout_s: float | None = None) -> Any:
        return self._call(self._client.predict(model, inputs, timeout_s),
                          self._budget(timeout_s))

    def submit(self, model: str, inputs: Any, timeout_s: float | None = None
               ) -> concurrent.futures.Future[Any]:
        """Enqueue and return at once; the future resolves to the output."""
        return asyncio.run_coroutine_threadsafe(
            self._client.predict(model, inputs, timeout_s), self._loop)

    def predict_many(self, model: str, inputs: Sequence[Any], timeout_s: float | None = None,
                     *, return_exceptions: bool = False) -> list[Any]:
        coro = self._client.predict_many(model, inputs, timeout_s,
                                         return_exceptions=return_exceptions)
        return self._call(coro, self._budget(timeout_s))

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._call(self._client.close(), 10.0)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
