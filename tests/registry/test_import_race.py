"""Issue 35 item 1: ``apply()`` while other threads are inside ``import aiter.fused_moe``.

The import is held on an event by a finder placed in front of every other one
(as a third party's finder may be, so ours never sees that import), and
several threads import the module at once. Whatever the order, the MoE
patches must be applied once the import completes, and a later ``apply()``
applies whatever is still pending.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading

import pytest

import aiter_patches
from helpers.standin import use_stub_aiter
from helpers import registry_view
from helpers.polling import wait_until

MODULE = "aiter.fused_moe"
THREADS = 3


class HeldImport:
    """A meta-path finder that holds the execution of one module until ``proceed`` is set."""

    def __init__(self, module: str):
        self.module = module
        self.started, self.proceed = threading.Event(), threading.Event()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        real, gate = spec.loader, self

        class Held:
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                gate.started.set()
                assert gate.proceed.wait(30)
                real.exec_module(module)

        spec.loader = Held()
        return spec


def on_module() -> list[str]:
    """The patches whose modules the stand-in has and that target ``MODULE``."""
    return [n for n in registry_view.stand_in_names() if MODULE in registry_view.modules(n)]


def states() -> dict[str, str]:
    return {p["name"]: p["state"] for p in aiter_patches.status()["patches"]}


def importing(held: HeldImport) -> list[threading.Thread]:
    """``THREADS`` threads importing ``MODULE`` (one runs it, the others wait for it), once the first holds it."""
    errors: list[BaseException] = []

    def run():
        try:
            importlib.import_module(MODULE)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for t in threads:
        t.start()
    assert held.started.wait(30)
    threads.append(errors)  # type: ignore[arg-type]
    return threads


def finish(held: HeldImport, threads) -> None:
    *threads, errors = threads
    held.proceed.set()
    for t in threads:
        t.join(30)
    sys.meta_path.remove(held)
    assert not any(t.is_alive() for t in threads) and not errors, errors


@pytest.mark.parametrize("applied_before", [False, True], ids=["first apply during the import",
                                                                 "pending before the import"])
def test_apply_during_an_import_in_other_threads_applies_when_it_completes(applied_before):
    with use_stub_aiter():
        names = on_module()
        assert names, "no patch of the stand-in targets aiter.fused_moe"
        if applied_before:
            assert set(names) <= set(aiter_patches.apply().pending)
        held = HeldImport(MODULE)
        sys.meta_path.insert(0, held)  # in front of ours: the import goes past the watch set before it
        threads = importing(held)
        try:
            report = aiter_patches.apply()
            assert {n: report[n]["state"] for n in names} == dict.fromkeys(names, "pending")
        finally:
            finish(held, threads)
        assert wait_until(lambda: all(states()[n] == "applied" for n in names)), states()
        assert states() == registry_view.expected_on_stand_in()
        fm = sys.modules[MODULE]
        assert getattr(fm.fused_moe, "__aiter_patches__", None) is not None


def test_a_later_apply_applies_what_an_unseen_import_left_pending():
    with use_stub_aiter():
        names = on_module()
        assert set(names) <= set(aiter_patches.apply().pending)
        held = HeldImport(MODULE)
        sys.meta_path.insert(0, held)
        finish(held, importing(held))  # no apply() while it ran: no hook of ours saw it
        assert MODULE in sys.modules
        report = aiter_patches.apply()
        assert {n: report[n]["state"] for n in names} == dict.fromkeys(names, "applied"), report
        assert states() == registry_view.expected_on_stand_in()
