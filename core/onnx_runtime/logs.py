"""Logging through Python's ``logging``, with onnxruntime's severity levels and session log ids.

onnxruntime's severities are 0 verbose, 1 info, 2 warning, 3 error, 4 fatal; ``SessionOptions.log_severity_level``
(default 2) and ``RunOptions.log_severity_level`` choose what a session and a run report, and
``set_default_logger_severity`` sets the process default. Records go to the ``onnx_runtime`` logger, each prefixed
with the session's ``logid``. As onnxruntime prints to stderr with no setup, a session that asks for verbose or info
records while the application configured no logging gets one stderr handler; an application that configured
logging keeps its handlers and filters.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    import logging

# logging's DEBUG, INFO, WARNING, ERROR and CRITICAL: the module itself is imported at the first record a session
# lets through (or asks to see), as most processes never log one
LEVELS = {0: 10, 1: 20, 2: 30, 3: 40, 4: 50}
NAMES = {0: "VERBOSE", 1: "INFO", 2: "WARNING", 3: "ERROR", 4: "FATAL"}

_default_severity = 2
_stderr_handler: logging.Handler | None = None


def logger() -> logging.Logger:
    """The ``onnx_runtime`` logger, where sessions' records go."""
    import logging

    return logging.getLogger("onnx_runtime")


def set_default_logger_severity(severity: int) -> None:
    """The severity of records a session logs when its options do not say (onnxruntime's function)."""
    global _default_severity
    _default_severity = checked_severity(severity, "set_default_logger_severity")


def set_default_logger_verbosity(verbosity: int) -> None:
    """onnxruntime's verbosity of VLOG records; verbose records here have one level, so it is only checked."""
    if not isinstance(verbosity, int) or verbosity < 0:
        raise InvalidArgumentError(f"logger verbosity must be an int >= 0, got {verbosity!r}")


def checked_severity(severity, where: str) -> int:
    if isinstance(severity, bool) or not isinstance(severity, int) or severity not in LEVELS:
        raise InvalidArgumentError(
            f"{where} is {severity!r}; onnxruntime's severities are 0 (verbose), 1 (info), 2 (warning), 3 (error) "
            f"and 4 (fatal)"
        )
    return severity


class SessionLog:
    """What one session logs, at or above its severity, under its log id."""

    __slots__ = ("severity", "logid")

    def __init__(self, severity: int | None, logid: str):
        self.severity = _default_severity if severity is None else checked_severity(severity, "log_severity_level")
        self.logid = logid
        if self.severity < 2:
            _make_visible(LEVELS[self.severity])

    def enabled(self, severity: int) -> bool:
        return severity >= self.severity

    def log(self, severity: int, message: str, *args) -> None:
        if severity >= self.severity:
            logger().log(LEVELS[severity], "[%s] " + message, self.logid, *args)

    def verbose(self, message: str, *args) -> None:
        self.log(0, message, *args)

    def info(self, message: str, *args) -> None:
        self.log(1, message, *args)

    def warning(self, message: str, *args) -> None:
        self.log(2, message, *args)


def _make_visible(level: int) -> None:
    """Let records of ``level`` through the ``onnx_runtime`` logger; with no logging configured anywhere, print
    them to stderr as onnxruntime does."""
    import logging

    global _stderr_handler
    records = logger()
    if records.getEffectiveLevel() > level:
        records.setLevel(level)
    if _stderr_handler is None and not records.handlers and not logging.getLogger().handlers:
        _stderr_handler = logging.StreamHandler(sys.stderr)
        _stderr_handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s:%(name)s] %(message)s"))
        records.addHandler(_stderr_handler)
