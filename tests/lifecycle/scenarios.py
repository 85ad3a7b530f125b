"""One lifecycle case per process: ``python scenarios.py CASE`` exits 0 and prints ``OK CASE`` when every check passed.

Each case drives the registry through one order of events (import, apply,
revert, fork, spawn, threads) on the stand-in AITER, for each registered patch
alone and for all together, and after every step checks every binding by
identity against ``status()`` (bindings.py). Patch names and target modules
come from the registry: a patch whose modules the stand-in lacks must stay
pending, never be reported applied.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.machinery
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: helpers.registry_view
sys.path.insert(0, str(HERE))

import aiter_patches  # noqa: E402
from aiter_patches import Patch, Pin, Target, registry  # noqa: E402
from aiter_patches.core import fork as core_fork  # noqa: E402
from aiter_patches_standin import use as use_stub_aiter  # noqa: E402
from bindings import Bindings, names  # noqa: E402
from helpers import registry_view  # noqa: E402
from helpers.polling import wait_until  # noqa: E402

CHILD_TIMEOUT_S = float(os.environ.get("LIFECYCLE_CHILD_TIMEOUT_S", "60"))


def stand_in_modules() -> list[str]:
    return sorted({m for n in registry_view.stand_in_names() for m in registry_view.modules(n)})


def import_all() -> None:
    for m in stand_in_modules():
        importlib.import_module(m)


def alone(name: str) -> dict[str, str]:
    """Expected states once only ``name`` (with the patches it needs) was applied and every stand-in module is imported."""
    applied = registry_view.with_needs(name)
    return {n: registry_view.expected_on_stand_in()[n] if n in applied else _off(n) for n in names()}


def inactive() -> dict[str, str]:
    return {n: _off(n) for n in names()}


def _off(name: str) -> str:
    """An opt-in server integration left off by the switch is ``disabled`` once an apply() saw it (revert keeps
    that, as for AITER_PATCHES_DISABLE), ``inactive`` before: the matrix does not exercise it."""
    if registry_view.opt_in_off(name) and registry.state(name) == "disabled":
        return "disabled"
    return "inactive"


def everything() -> dict[str, str]:
    return registry_view.expected_on_stand_in()


def states() -> dict[str, str]:
    return {p["name"]: p["state"] for p in aiter_patches.status()["patches"]}


def fork_and_wait(child) -> int:
    """Run ``child()`` in a forked child; its exit status (1 if it raised), failing on a hang."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGABRT)  # faulthandler prints where every thread of the child is stuck
            time.sleep(1)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"forked child {pid} hung")
        time.sleep(0.005)


# ---------------------------------------------------------------- cases

def case_import_then_apply() -> None:
    for name in [*names(), None]:
        with use_stub_aiter():
            import_all()
            b = Bindings()
            b.snapshot()
            b.check(inactive())
            aiter_patches.apply(None if name is None else [name])
            b.check(everything() if name is None else alone(name))
            registry.revert()
            b.check(inactive())


def case_apply_then_import() -> None:
    for name in [*names(), None]:
        with use_stub_aiter():  # imports the package `aiter` only, as a server's first `import aiter` does
            b = Bindings()
            report = aiter_patches.apply(None if name is None else [name])
            assert name is not None or report.pending, f"nothing left to wait for: {dict(report)}"
            b.check()
            import_all()
            b.check(everything() if name is None else alone(name))
            registry.revert()
            b.check(inactive())


def case_apply_revert_apply() -> None:
    for name in [*names(), None]:
        with use_stub_aiter():
            import_all()
            b = Bindings()
            b.snapshot()
            want = everything() if name is None else alone(name)
            for _ in range(2):
                aiter_patches.apply(None if name is None else [name])
                b.check(want)
                registry.revert()
                b.check(inactive())


def case_revert_before_import() -> None:
    with use_stub_aiter():
        b = Bindings()
        assert aiter_patches.apply().pending
        registry.revert()
        b.check(inactive())
        import_all()
        b.snapshot()  # raises if any wrapper was installed by a hook that should have been cancelled
        b.check(inactive())


class BlockingImport:
    """A meta-path finder that holds the execution of one module until released: an import in progress."""

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
                assert gate.proceed.wait(CHILD_TIMEOUT_S)
                real.exec_module(module)

        spec.loader = Held()
        return spec


def case_apply_during_import() -> None:
    for name in [*names(), None]:
        with use_stub_aiter():
            waiting = [m for m in stand_in_modules() if m not in sys.modules]
            if name is not None:
                waiting = [m for m in waiting if any(m in registry_view.modules(n) for n in registry_view.with_needs(name))]
            if not waiting:
                continue  # this patch's modules come with `import aiter`: nothing is in progress
            held = BlockingImport(waiting[0])
            sys.meta_path.insert(0, held)
            errors: list[BaseException] = []

            def importer():
                try:
                    import_all()
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=importer)
            t.start()
            try:
                assert held.started.wait(CHILD_TIMEOUT_S)
                report = aiter_patches.apply(None if name is None else [name])
                assert not report.skipped, f"skipped during an import in progress: {dict(report)}"
            finally:
                held.proceed.set()
                t.join(CHILD_TIMEOUT_S)
                sys.meta_path.remove(held)
            assert not t.is_alive() and not errors, errors
            want = everything() if name is None else alone(name)
            assert wait_until(lambda: states() == want), states()
            b = Bindings()
            b.check(want)
            registry.revert()
            b.check(inactive())


def case_fork_after_apply() -> None:
    with use_stub_aiter():
        import_all()
        b = Bindings()
        b.snapshot()
        aiter_patches.apply()
        b.check(everything())

        def child():
            b.check(everything())
            aiter_patches.apply()
            b.check(everything())
            registry.revert()
            b.check(inactive())
            aiter_patches.apply()
            b.check(everything())

        assert fork_and_wait(child) == 0
        b.check(everything())


def case_fork_during_apply() -> None:
    with use_stub_aiter():
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                aiter_patches.apply()
                registry.revert()

        t = threading.Thread(target=churn)
        t.start()
        try:
            for _ in range(4):
                def child():
                    Bindings().check()  # whatever the parent was doing, status() matches what is live
                    registry.revert()
                    aiter_patches.apply()
                    import_all()
                    b = Bindings()
                    b.check(everything())
                    registry.revert()
                    b.check(inactive())

                assert fork_and_wait(child) == 0
        finally:
            stop.set()
            t.join(CHILD_TIMEOUT_S)
        registry.revert()
        Bindings().check(inactive())


def case_fork_while_the_lock_is_held() -> None:
    """Another thread is inside the registry for longer than fork() waits: the child gets fresh locks."""
    with use_stub_aiter():
        aiter_patches.apply()  # the patches on modules not imported yet are pending
        inside, release = threading.Event(), threading.Event()
        slow_wait = core_fork.FORK_WAIT_S + 2

        def slow_factory(inner, site):
            inside.set()
            release.wait(slow_wait)

            def slow_wrapper(*args, **kwargs):
                return inner(*args, **kwargs)

            return slow_wrapper

        target = types.ModuleType("lifecycle_target")
        exec("def f(x):\n    return x\n", target.__dict__)
        sys.modules[target.__name__] = target
        registry.register(Patch("lifecycle_slow", "holds the registry lock in its wrapper factory",
                                (Target(target.__name__, "f", (Pin("any", "(x)"),), slow_factory),)))
        try:
            t = threading.Thread(target=aiter_patches.apply, args=(["lifecycle_slow"],))
            t.start()
            assert inside.wait(CHILD_TIMEOUT_S)

            def child():
                import_all()
                b = Bindings()
                want = dict(everything(), lifecycle_slow="inactive")
                b.check(want)
                registry.revert()
                b.check(dict(inactive(), lifecycle_slow="inactive"))

            started = time.monotonic()
            assert fork_and_wait(child) == 0
            assert time.monotonic() - started < CHILD_TIMEOUT_S
            release.set()
            t.join(CHILD_TIMEOUT_S)
        finally:
            release.set()
            registry.revert()
            registry.unregister("lifecycle_slow")


def _spawned(queue) -> None:
    try:
        with use_stub_aiter():
            assert states() == inactive(), "a spawned child inherits nothing: it has its own registry"
            aiter_patches.apply()
            import_all()
            b = Bindings()
            b.check(everything())
            registry.revert()
            b.check(inactive())
        queue.put("ok")
    except BaseException as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def case_spawned_child() -> None:
    import multiprocessing as mp

    with use_stub_aiter():
        import_all()
        b = Bindings()
        b.snapshot()
        aiter_patches.apply()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        p = ctx.Process(target=_spawned, args=(queue,))
        p.start()
        try:
            assert queue.get(timeout=CHILD_TIMEOUT_S * 2) == "ok"
        finally:
            p.join(CHILD_TIMEOUT_S)
            if p.is_alive():
                p.kill()
        assert p.exitcode == 0
        b.check(everything())
        registry.revert()
        b.check(inactive())


CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}

if __name__ == "__main__":
    faulthandler.enable()
    case = sys.argv[1]
    CASES[case]()
    print(f"OK {case}")
