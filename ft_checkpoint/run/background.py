"""Background work that still happens at interpreter exit.

Python's own exit handler for ``concurrent.futures`` runs before ``atexit`` handlers and makes every
executor refuse new work ("cannot schedule new futures after interpreter shutdown"). A manager closed at
exit (see ``CheckpointManager``) still has journal events and retention to do: they then run on the
calling thread instead.

Example:
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> pool = ThreadPoolExecutor(1); pool.shutdown()
    >>> submit(pool, lambda x: x + 1, 41).result()
    42
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


def submit(executor: Executor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``executor.submit(fn, *args)``, or, once the executor (or the interpreter) shuts down, ``fn(*args)`` now."""
    try:
        return executor.submit(fn, *args)
    except RuntimeError:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future
