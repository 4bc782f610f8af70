"""The launcher's own errors as one line on the terminal, from whichever rank reaches them first.

Every rank validates the command line and the configuration alike, before any process group
exists, so every rank finds a bad option. Under torchrun, the first rank to exit non-zero makes
the elastic agent stop all the others (SIGTERM within its monitor interval, 0.1 s by default)
and print its ``ChildFailedError`` summary; had only rank 0 printed the error, a faster rank's
exit could kill rank 0 before it did, leaving the user torchrun's summary alone.

So the first rank to reach the verdict prints it, once: the ranks count themselves in through the
job's own key-value store (torchrun's agent hosts one, ``TORCHELASTIC_USE_AGENT_STORE=True``),
and the others wait until the printer says it has flushed the line before they exit with the same
status. Every rank also writes its torchrun error file (``TORCHELASTIC_ERROR_FILE``, read only by
torchrun's summary), so the summary torchrun prints at the end names the error too, with the exit
status of whichever rank it reports as the first failure.

Outside torchrun (one process, or ranks started by hand with torchrun's variables), nothing kills
a rank whose peer exits, and rank 0 prints alone. A rank whose ``RANK`` / ``WORLD_SIZE`` make no
rank of a world (not integers, or the rank out of range) prints too: no rank 0 may be there, and
the message may be about that environment.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Mapping

__all__ = ["WAIT_S", "report_once"]

#: Seconds a rank waits for the store, and for the printing rank to flush its line.
WAIT_S = 10.0
_KEY = "shardattn.launch/error/{restart}"


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _write_error_file(message: str, environ: Mapping[str, str]) -> None:
    """Put the message where torchrun's ``ChildFailedError`` summary reads a rank's error (best effort).

    The file appears whole or not at all (written beside it, then renamed): torchrun stops the other
    ranks as soon as one exits and reads each stopped rank's file if it exists, and an empty or
    half-written one made torchrun itself fail (``JSONDecodeError``) instead of printing its summary.
    """
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(partial)


def _env_int(env: Mapping[str, str], name: str, default: int) -> int | None:
    """``env[name]`` as an int (``default`` when unset or empty); ``None`` when it is no integer."""
    try:
        return int(env.get(name, "") or default)
    except ValueError:
        return None


def report_once(message: str, status: int, *, environ: Mapping[str, str] | None = None, wait_s: float = WAIT_S) -> int:
    """Print ``message`` (one line, stderr) from exactly one rank of the job, then return ``status``.

    Under torchrun's agent store the first rank to call this prints and the others wait (at most
    ``wait_s``) until it has; elsewhere rank 0 prints. If the store cannot be reached, the rank
    prints anyway (a line twice is better than none).
    """
    env = os.environ if environ is None else environ
    rank, world = _env_int(env, "RANK", 0), _env_int(env, "WORLD_SIZE", 1)
    if rank is None or world is None or not 0 <= rank < world:  # no rank of a world: the message may say why
        _print(message)
        _write_error_file(message, env)
        return status
    if world <= 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        if rank == 0:
            _print(message)
            _write_error_file(message, env)
        return status
    try:
        from torch.distributed import TCPStore

        store = TCPStore(
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=wait_s),
        )
        key = _KEY.format(restart=env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        first = store.add(key, 1) == 1
    except Exception:  # no store after all: say it here
        _print(message)
        _write_error_file(message, env)
        return status
    _write_error_file(message, env)  # every rank's: torchrun's summary names the first to exit, any of them
    if first:
        _print(message)
        store.set(f"{key}/printed", "1")
    else:
        try:
            store.wait([f"{key}/printed"], datetime.timedelta(seconds=wait_s))
        except Exception:  # the printer is gone without a word: say it here
            _print(message)
    return status
