"""Work that should ride right behind the sort launch (a shared expert's GEMM, say), else run at scope exit.

The callable runs once, on the current stream: right after the first sort call
in the scope, or, if no sort call came, when the scope exits. ``ran_after_sort``
and ``ran_at_exit`` count which.
"""

from __future__ import annotations

from typing import Any, Callable

from .api import SortCall, SortExtension


class DeferredWork(SortExtension):
    def __init__(self, fn: Callable[[], Any]):
        self._fn: Callable[[], Any] | None = fn
        self.result: Any = None
        self.ran_after_sort = 0
        self.ran_at_exit = 0

    def after_sort(self, call: SortCall, outputs: tuple) -> None:
        if self._fn is not None:
            self.result = self._run()
            self.ran_after_sort += 1

    def close(self) -> None:
        if self._fn is not None:
            self.result = self._run()
            self.ran_at_exit += 1

    def _run(self) -> Any:
        fn, self._fn = self._fn, None
        return fn()
