"""structlog configured once per process: JSON lines in services, console for humans."""

from __future__ import annotations

import logging
import sys

import structlog

from asyncrl.settings import settings


def configure_logging(service: str, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog for `service`. JSON unless ASYNCRL_LOG_FORMAT=console."""
    config = settings()
    if json is None:
        json = config.log_format == "json"
    lvl = getattr(logging, (level or config.log_level).upper())
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(**ctx):
    """A lazy logger: safe at module level, it picks up configure_logging() called later."""
    return structlog.get_logger(**ctx)
