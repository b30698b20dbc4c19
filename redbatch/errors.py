"""One rooted exception tree (httpx style).

Every error that crosses a redbatch boundary is a ``RedbatchError``.  Errors that
travel on the wire carry a stable ``code`` (listed in ``docs/protocol.md``);
``error_from_code`` turns a reply's error back into the matching exception.
"""

from __future__ import annotations

from redbatch import defaults


class RedbatchError(Exception):
    """Root of every redbatch error."""

    code = "internal"
    request_id = ""  # the request it befell, once it had an id (a stream's, say)


class ConfigError(RedbatchError):
    """A setting is missing or has a bad value."""

    code = "config_error"


class InvalidKnob(ConfigError):
    """A live batching knob with an unknown name or a bad value (HTTP 422)."""

    code = "invalid_knob"


class RedisUnavailable(RedbatchError):
    """Redis could not be reached, or the connection broke mid-command."""

    code = "redis_unavailable"


class QueueFull(RedbatchError):
    """The model's queue is at its cap: retry later."""

    code = "queue_full"

    def __init__(self, message: str, retry_after_s: float = defaults.RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(RedbatchError):
    """The request's deadline passed before a reply arrived."""

    code = "deadline_exceeded"


class InvalidPayload(RedbatchError):
    """The request (or a queue entry) could not be decoded or validated."""

    code = "invalid_payload"


class BadRequest(RedbatchError):
    """An HTTP request the gateway cannot read: empty, malformed JSON, a bad header."""

    code = "bad_request"


class ClientDisconnected(BadRequest):
    """The HTTP client went away before its answer (counted as ``cancelled``; the
    request is marked cancelled, so a worker skips it)."""

    code = "client_disconnected"


class BodyTooLarge(RedbatchError):
    """An HTTP request body over the gateway's limit."""

    code = "body_too_large"


class UnsupportedMediaType(RedbatchError):
    """A predict body whose Content-Type is not JSON (a browser's form or text post)."""

    code = "unsupported_media_type"


class UnknownModel(RedbatchError):
    """No worker has ever registered a model of this name."""

    code = "unknown_model"


class NoLiveWorkers(RedbatchError):
    """No worker holds a live lease for the model: nothing would serve the request."""

    code = "no_workers"


class ModelError(RedbatchError):
    """The model raised, or broke the batch contract (e.g. wrong output length)."""

    code = "model_error"


class WorkerCrashed(RedbatchError):
    """Workers crashed on this request too many times; it was dead-lettered."""

    code = "worker_crashed"


_BY_CODE: dict[str, type[RedbatchError]] = {
    cls.code: cls
    for cls in (
        RedbatchError,
        ConfigError,
        InvalidKnob,
        RedisUnavailable,
        QueueFull,
        DeadlineExceeded,
        InvalidPayload,
        BadRequest,
        BodyTooLarge,
        UnsupportedMediaType,
        UnknownModel,
        NoLiveWorkers,
        ModelError,
        WorkerCrashed,
    )
}


def error_from_code(code: str, message: str) -> RedbatchError:
    """Build the exception that a reply's error ``code`` stands for."""
    return _BY_CODE.get(code, RedbatchError)(message)
