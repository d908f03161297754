"""Ctrl-C and SIGTERM stop a command the same way: a KeyboardInterrupt, and a flag that says it happened.

The flag lives here, in one module, because the CLI runs as ``python -m
reflow.cli.main``: its ``__main__`` and a later ``import reflow.cli.main``
(``start_ray`` re-installs the handlers) would otherwise be two modules with
two flags, and the handler that fires would set the one ``main`` never reads.
"""

from __future__ import annotations

import logging
import signal
import threading

INTERRUPTED = threading.Event()


class QuietAfterInterrupt(logging.Filter):
    """Once a stop signal came, records keep their message but lose their traceback.

    The KeyboardInterrupt can land inside a library's bookkeeping (Prefect's
    task engine before its task run exists) and come out as another
    exception, which Prefect logs with a traceback: that is the stop, not a
    fault, and the command says so in one line (exit 130).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if INTERRUPTED.is_set() and record.exc_info:
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_handlers() -> None:
    """Put ``QuietAfterInterrupt`` on every logging handler there is now (root's and each named logger's)."""
    loggers = [logging.getLogger()] + [v for v in logging.root.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger)]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if not any(isinstance(f, QuietAfterInterrupt) for f in handler.filters):
            handler.addFilter(QuietAfterInterrupt())


def raise_interrupt(signum: int, frame: object) -> None:
    INTERRUPTED.set()
    _quiet_handlers()
    raise KeyboardInterrupt(f"signal {signum}")


def interrupt_on_signals() -> None:
    """Make SIGTERM (``kill``, a job scheduler) stop a command like Ctrl-C: same cleanup, exit 130.

    Ray installs its own SIGTERM handler when it starts (it drains the node
    for up to 30 s, then exits 1 without our cleanup), so ``start_ray`` calls
    this again afterwards. Only the main thread can install handlers. Both
    signals also set ``INTERRUPTED``: the KeyboardInterrupt can land inside a
    library's own cleanup (Prefect's crash handler, say) and come out as
    another exception, and the command must still exit 130.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupt)
        signal.signal(signal.SIGINT, raise_interrupt)
