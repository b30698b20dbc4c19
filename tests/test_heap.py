"""The startup heap of a gateway or worker process is frozen out of the collector."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from redbatch.api import serve
from redbatch.heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's objects go back to the collector


@pytest.mark.usefixtures("unfrozen")
def test_freeze_moves_live_objects_out_of_the_collector() -> None:
    keep = [[i] for i in range(1000)]  # survives the collection, so it is frozen
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(keep)
    assert not any(gc.is_tracked(o) and o in gc.get_objects(2) for o in keep[:3])


@pytest.mark.usefixtures("unfrozen")
def test_the_uvicorn_factory_freezes_once_the_app_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # not contacted: no lifespan
    monkeypatch.setattr(serve, "setup_logging", lambda: None)  # leave pytest's logging be
    assert gc.get_freeze_count() == 0
    app = serve.app_from_env()
    assert gc.get_freeze_count() > 0
    assert app.state.gateway is not None
