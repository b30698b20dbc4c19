"""Which optional extra provides a module: `pip install redbatch` is the producer only,
so a command that needs more says which extra to install instead of a traceback."""

from __future__ import annotations

EXTRA_OF: dict[str, str] = {
    "torch": "worker",
    "uvloop": "worker",
    "starlette": "gateway",
    "uvicorn": "gateway",
    "prometheus_client": "gateway",
    "rq": "jobs",
    "httpx": "jobs",
    "rich": "status",
    "fakeredis": "embedded",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """How to install what ``exc`` lacks, or None for a module no extra provides."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return f"{top} is not installed: pip install 'redbatch[{extra}]' (or 'redbatch[all]')"
