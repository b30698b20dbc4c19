"""The HTTP gateway."""

from redbatch.api.app import Gateway, create_app

__all__ = ["Gateway", "create_app"]
