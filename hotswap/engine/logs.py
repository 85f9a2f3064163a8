"""hotswap's log, the PyTorch way: ``TORCH_LOGS="hotswap"`` (INFO) or ``"+hotswap"`` (DEBUG),
``torch._logging.set_logs(modules={"hotswap": logging.DEBUG})``, or the standard ``logging``
configuration of the ``hotswap`` logger.

Where nothing configures logging (no handler on the root logger, none on ``hotswap``, no
``TORCH_LOGS`` naming it), a script still sees what matters, one line each on stderr: a tier
swapped in, a tier kept out by the gate, a tier that failed (``HOTSWAP_LOG=warning`` keeps
only failures; ``off`` nothing). That default handler steps aside as soon as the root logger
gets a handler (``logging.basicConfig`` later), so nothing is printed twice.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from hotswap import settings

__all__ = ["log_setting", "setup_logging"]

_done = threading.Lock()
_set_up = False


class _Default(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, until the application configures logging itself."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        return message if message.startswith("hotswap") else f"hotswap: {message}"


def log_setting() -> int | None:
    """HOTSWAP_LOG as a level (None: off); ValueError naming it when malformed."""
    return settings.log_level()


def setup_logging() -> None:
    """Once per process, when the first coordinator is made (torch is imported by then)."""
    global _set_up
    with _done:
        if _set_up:
            return
        _set_up = True
    try:  # TORCH_LOGS takes "hotswap" as a module name too; registered, it is one of torch's
        from torch._logging._internal import register_log

        register_log("hotswap", "hotswap")
    except Exception:  # an internal API: without it TORCH_LOGS still knows the module
        pass
    level = log_setting()
    logger = logging.getLogger("hotswap")
    if (level is None or logger.handlers or logging.getLogger().handlers
            or "hotswap" in os.environ.get("TORCH_LOGS", "")):
        return
    handler = _Default(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(_Prefixed("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
