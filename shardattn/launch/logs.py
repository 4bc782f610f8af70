"""The command-line tools' logging: the library's records on stderr at the level asked for.

The library logs on ``logging.getLogger("shardattn")`` and its children (route decisions at debug
level, warnings such as a step that bypasses the workspace) and configures no handler itself;
``python -m shardattn.launch`` and ``python -m shardattn.calibrate`` call :func:`configure_logging`
with their ``--log-level``.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG_LEVELS", "configure_logging"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str, rank: int = 0) -> None:
    """Show the ``shardattn`` loggers' records at ``level`` and above on stderr, each line naming the
    rank; Python warnings (a missing calibration table: ``CalibrationWarning``) go there too."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(name)s [rank {rank}]: %(message)s"))
    for name in ("shardattn", "py.warnings"):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        logger.handlers = [handler]
        logger.propagate = False
    logging.captureWarnings(True)
