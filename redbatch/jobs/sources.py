"""A bulk job's input set: an inline list or array, or a ``.npy`` / ``.jsonl`` file given
by a path or an http(s) URL.

* ``.npy``: one input per row along the first axis (read memory-mapped, so a file larger
  than memory works); the rows of a 1-D array are sent as plain numbers.
* ``.jsonl`` (or ``.ndjson``): one JSON value per non-empty line.  A line that is not
  valid JSON becomes a ``BadRow``: that item fails alone, the others still run.
* a URL is downloaded (streamed) to a temporary file first, for the job's lifetime.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from redbatch.jobs.errors import BadSource

FORMATS = {".npy": "npy", ".jsonl": "jsonl", ".ndjson": "jsonl"}
DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class BadRow:
    """An input that could not be read at all (a malformed ``.jsonl`` line)."""

    message: str


@dataclass
class Inputs:
    total: int
    items: Iterator[Any]


def is_url(source: object) -> bool:
    """An http(s) URL, its scheme in any case (``HTTPS://`` too: never a file path)."""
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def file_format(name: str) -> str:
    """``npy`` or ``jsonl`` from a file name or URL path, else ``BadSource``."""
    try:
        path = urlsplit(name).path if is_url(name) else name
    except ValueError:  # (its message quotes the URL's user and password)
        raise BadSource("the source URL does not parse") from None
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise BadSource(f"{describe(name)}: unknown format {suffix or '(no suffix)'!r}; "
                        f"use one of {sorted(FORMATS)}")
    return FORMATS[suffix]


def describe(source: Any) -> str:
    """A short, credential-free description (for job descriptions and logs)."""
    if isinstance(source, np.ndarray):
        return f"<inline array {source.dtype} {list(source.shape)}>"
    if isinstance(source, list | tuple):
        return f"<{len(source)} inline items>"
    if is_url(source):
        parts = urlsplit(source)  # no user:password@, no query (signed URLs carry tokens)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}" \
               f"{parts.path}"
    return str(source)


def check_source(source: Any) -> Any:
    """Validate a source at submit time; local paths become absolute (the RQ worker may
    run in another directory)."""
    if isinstance(source, np.ndarray | list):
        return source
    if isinstance(source, tuple):
        return list(source)
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        file_format(name)
        if is_url(name) and "@" in urlsplit(name).netloc:  # (RQ shows a job's arguments)
            raise BadSource("a source URL may not hold a user or password: they would be "
                            "stored in the job in clear; use a signed URL")
        return name if is_url(name) else os.path.abspath(os.path.expanduser(name))
    raise BadSource(f"source must be a list, an array, a path or an http(s) URL, not "
                    f"{type(source).__name__}")


def check_output(output: str | os.PathLike[str] | None) -> str | None:
    """An absolute ``.npy`` / ``.jsonl`` path, or None."""
    if output is None:
        return None
    name = os.fspath(output)
    if is_url(name):
        raise BadSource("output must be a local (or shared) file path, not a URL")
    file_format(name)
    return os.path.abspath(os.path.expanduser(name))


@contextlib.contextmanager
def open_source(source: Any) -> Iterator[Inputs]:
    """The items of ``source`` and how many there are, valid inside the ``with``."""
    if isinstance(source, np.ndarray):
        yield _array_inputs(source)
    elif isinstance(source, list | tuple):
        yield Inputs(len(source), iter(source))
    elif isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        fmt = file_format(name)
        with contextlib.ExitStack() as stack:
            path = stack.enter_context(_download(name)) if is_url(name) else Path(name)
            yield _npy_inputs(path) if fmt == "npy" else _jsonl_inputs(path, stack)
    else:
        raise BadSource(f"cannot read a source of type {type(source).__name__}")


def _array_inputs(arr: np.ndarray[Any, Any]) -> Inputs:
    if arr.ndim == 0:
        raise BadSource("an array source needs at least one dimension (rows)")
    if arr.ndim == 1:
        return Inputs(len(arr), (row.item() for row in arr))
    return Inputs(len(arr), (np.array(row) for row in arr))


def _npy_inputs(path: Path) -> Inputs:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BadSource(f"cannot read {path} as .npy: {exc}") from exc
    return _array_inputs(arr)


def _jsonl_inputs(path: Path, stack: contextlib.ExitStack) -> Inputs:
    try:
        with path.open("rb") as counting:
            total = sum(1 for line in counting if line.strip())
        lines = stack.enter_context(path.open("rb"))
    except OSError as exc:
        raise BadSource(f"cannot read {path}: {exc}") from exc
    return Inputs(total, _jsonl_rows(lines))


def _jsonl_rows(lines: Iterator[bytes]) -> Iterator[Any]:
    """Each non-blank line's value; a line that is not UTF-8 JSON (json.loads of bytes
    would guess UTF-16 or UTF-32 line by line), or that nests past the parser's depth,
    fails alone."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
            yield json.loads(text)
        except UnicodeDecodeError as exc:
            yield BadRow(f"line {number}: not UTF-8 ({exc.reason}): a .jsonl file is UTF-8")
        except (ValueError, RecursionError) as exc:
            yield BadRow(f"line {number}: invalid JSON: {exc}")


@contextlib.contextmanager
def _download(url: str) -> Iterator[Path]:
    """Stream ``url`` into a temporary file, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="redbatch-bulk-") as tmp:
        path = Path(tmp) / f"input{Path(urlsplit(url).path).suffix}"
        try:
            with httpx.stream("GET", url, timeout=DOWNLOAD_TIMEOUT_S,
                              follow_redirects=True) as resp, path.open("wb") as out:
                resp.raise_for_status()
                for block in resp.iter_bytes(1 << 20):
                    out.write(block)
        except httpx.HTTPStatusError as exc:  # never the URL itself: it may hold a token
            raise BadSource(f"cannot download {describe(url)}: HTTP "
                            f"{exc.response.status_code}") from None
        except httpx.HTTPError as exc:
            raise BadSource(f"cannot download {describe(url)}: "
                            f"{type(exc).__name__}") from None
        yield path
