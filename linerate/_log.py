"""``LINERATE_LOG_LEVEL``: the level of linerate's loggers, applied when a process group is
created (collectives/backend.py).

linerate logs through the standard ``logging`` module, under the logger ``linerate`` and the
loggers below it (``linerate.transport``, ``linerate.collectives``, ``linerate.metrics``,
``linerate.rdma``). Unset, the setting changes nothing: the process's logging configuration
decides, and Python's default prints warnings and errors to stderr. Set, it sets the level of
``linerate``; where the process has configured no handler (neither on the root logger nor on
``linerate``), a handler that writes to stderr is added, which stands aside as soon as the root
logger has a handler of its own (no line is printed twice).
"""
from __future__ import annotations

import logging
import sys

LOGGER = "linerate"
FORMAT = "%(asctime)s %(levelname)s %(name)s pid %(process)d: %(message)s"


class _Stderr(logging.StreamHandler):
    """stderr, while the process has configured no logging of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # configured since: the root's handlers print it
            return
        super().emit(record)


_handler: _Stderr | None = None


def configure(level: str | None = None) -> None:
    """Apply ``level`` (default: LINERATE_LOG_LEVEL; "" leaves everything as it is)."""
    global _handler
    if level is None:
        from linerate import settings
        level = settings.read("LINERATE_LOG_LEVEL")
    if not level:
        return
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level)
    if _handler is None and not logger.handlers and not logging.getLogger().handlers:
        _handler = _Stderr(sys.stderr)
        _handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(_handler)
