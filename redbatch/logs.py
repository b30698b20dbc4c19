"""Logging set-up shared by every redbatch process."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("REDBATCH_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format=FORMAT, force=True)
