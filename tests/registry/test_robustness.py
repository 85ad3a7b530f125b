"""The registry under a hostile process: lazy modules, failing wrappers, foreign wrappers, imports in flight, strict retries.

Each test reproduces one failure of issue 14 on the small on-disk library of
tests/registry/fakelib.py (or the stand-in AITER where the issue names it).
"""

import functools
import importlib
import importlib.util
import logging
import sys
import threading
import types

import pytest
import wrapt

import aiter_patches
from helpers.polling import wait_until
from aiter_patches import Patch, PatchSkipped, Pin, Target, registry
from helpers.standin import use_stub_aiter
from helpers import registry_view
from helpers.live import live_bindings
from aiter_patches.core import state as core_state

from . import fakelib
from .test_registry import GOOD_PIN, bindings, lib, tagging  # noqa: F401  (lib is a fixture)

OTHER_PIN = Pin("v1", "(x)", "fakelib core.py")


def state(name):
    return next(r for r in aiter_patches.status()["patches"] if r["name"] == name)


def lazy_module(tmp_path, name, body):
    """Put ``name`` in sys.modules through importlib.util.LazyLoader: its code runs at the first attribute access."""
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    spec = importlib.util.spec_from_file_location(name, path)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def lazies(tmp_path):
    """A lazy module whose load fails and one whose load records that it ran; both taken out afterwards."""
    ran = types.ModuleType("_aiter_patches_test_ran")
    ran.log = []
    sys.modules[ran.__name__] = ran
    failing = lazy_module(tmp_path, "aiter_patches_test_lazy_fails", "raise ImportError('deferred load fails')\n")
    fine = lazy_module(tmp_path, "aiter_patches_test_lazy_fine",
                       f"import sys\nsys.modules[{ran.__name__!r}].log.append('executed')\nVALUE = 1\n")
    yield failing, fine, ran.log
    for m in (ran.__name__, "aiter_patches_test_lazy_fails", "aiter_patches_test_lazy_fine"):
        sys.modules.pop(m, None)


def still_lazy(module):
    return type(module).__name__ == "_LazyModule"


# ---------------------------------------------------------------- item 2: lazy modules, all or nothing

def test_apply_and_revert_never_execute_or_raise_for_lazy_modules(lib, lazies):
    pkg, mod, make_patch = lib
    failing, fine, ran = lazies
    make_patch("t_lazy")
    before = bindings(pkg)
    report = aiter_patches.apply(["t_lazy"])
    assert report.applied == ["t_lazy"]
    assert mod.call_target(1) == ("t_lazy", ("orig", 1, 1))
    aiter_patches.revert(["t_lazy"])
    assert bindings(pkg) == before
    assert ran == [], "a lazy module that loads fine was executed by the alias scan"
    assert still_lazy(failing) and still_lazy(fine)
    assert fine.VALUE == 1 and ran == ["executed"], "the lazy module itself still works"


def test_with_patches_pending_importing_aiter_does_not_raise_for_a_broken_lazy_module(lazies):
    failing, fine, ran = lazies
    with use_stub_aiter():
        report = aiter_patches.apply()
        due = [n for n in report.pending if n in registry_view.stand_in_names()]
        assert due, "some patch waits for a stand-in module"
        for m in sorted({m for n in due for m in registry_view.modules(n)}):
            importlib.import_module(m)  # must not raise the lazy module's error
        st = aiter_patches.status()
        assert {p["name"]: p["state"] for p in st["patches"] if p["name"] in due} == {n: "applied" for n in due}
    assert ran == [] and still_lazy(failing) and still_lazy(fine)


def test_a_lazy_target_module_is_waited_for_not_executed(tmp_path):
    ran = types.ModuleType("_aiter_patches_test_ran2")
    ran.log = []
    sys.modules[ran.__name__] = ran
    name = "aiter_patches_test_lazy_target"
    body = (f"import sys\nsys.modules[{ran.__name__!r}].log.append('executed')\n"
            "def target(x):\n    return ('orig', x)\n")
    module = lazy_module(tmp_path, name, body)
    registry.register(Patch("t_lazy_target", "lazy target", (Target(name, "target", (OTHER_PIN,), tagging("L")),)))
    try:
        report = aiter_patches.apply(["t_lazy_target"])
        assert report.pending == ["t_lazy_target"] and ran.log == [] and still_lazy(module)
        assert module.target(2) == ("L", ("orig", 2)), "applied when the lazy module ran"
        assert ran.log == ["executed"] and state("t_lazy_target")["state"] == "applied"
    finally:
        registry.unregister("t_lazy_target")
        for m in (name, ran.__name__):
            sys.modules.pop(m, None)


def test_a_patch_pending_on_a_lazy_module_is_reported_at_once(tmp_path, caplog, monkeypatch):
    """A lazy module may never run: the summary must not wait for its hook as for an imported module."""
    from aiter_patches import process_report

    monkeypatch.setattr(process_report, "_last_logged", None)
    name = "aiter_patches_test_lazy_report"
    lazy_module(tmp_path, name, "def target(x):\n    return x\n")
    registry.register(Patch("t_lazy_report", "lazy report", (Target(name, "target", (OTHER_PIN,), tagging("R")),)))
    try:
        with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
            assert aiter_patches.apply(["t_lazy_report"]).pending == ["t_lazy_report"]
        assert any(r.getMessage().startswith(process_report.MARKER) for r in caplog.records)
    finally:
        registry.unregister("t_lazy_report")
        sys.modules.pop(name, None)


def raising_factory(inner, site):
    raise RuntimeError("factory exploded")


def test_a_wrapper_factory_that_raises_midway_changes_nothing(lib):
    pkg, mod, make_patch = lib
    before = bindings(pkg)
    orig_other = mod.other
    make_patch("t_first_fails", attr="other", pins=(OTHER_PIN,),
               extra_targets=(Target(f"{pkg}.core", "target", (GOOD_PIN,), raising_factory),))
    report = aiter_patches.apply(["t_first_fails"])
    assert report.skipped == ["t_first_fails"]
    assert "factory exploded" in report["t_first_fails"]["reason"]
    assert f"{pkg}.core.target" in report["t_first_fails"]["reason"]
    assert mod.other is orig_other and bindings(pkg) == before
    assert registry.revert() == []
    assert mod.other is orig_other and bindings(pkg) == before


def test_a_failing_factory_on_a_shared_target_leaves_the_applied_patch_alone(lib):
    pkg, mod, make_patch = lib
    make_patch("t_applied", order=10)
    aiter_patches.apply(["t_applied"])
    head = bindings(pkg)
    make_patch("t_breaks", attr="other", pins=(OTHER_PIN,), order=20,
               extra_targets=(Target(f"{pkg}.core", "target", (GOOD_PIN,), raising_factory),))
    orig_other = mod.other
    assert aiter_patches.apply(["t_breaks"]).skipped == ["t_breaks"]
    assert bindings(pkg) == head and mod.other is orig_other
    assert mod.call_target(1) == ("t_applied", ("orig", 1, 1))


class _NoRebind(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "other":
            raise AttributeError("read-only in this module")
        super().__setattr__(name, value)


def test_a_binding_that_fails_midway_undoes_the_targets_done_and_skips(lib):
    pkg, mod, make_patch = lib
    core = sys.modules[f"{pkg}.core"]
    before = bindings(pkg)
    orig_other = core.other
    make_patch("t_bind_fails", extra_targets=(Target(f"{pkg}.core", "other", (OTHER_PIN,), tagging("o")),))
    core.__class__ = _NoRebind
    try:
        report = aiter_patches.apply(["t_bind_fails"])
    finally:
        core.__class__ = types.ModuleType
    assert report.skipped == ["t_bind_fails"]
    assert "read-only in this module" in report["t_bind_fails"]["reason"]
    assert bindings(pkg) == before and core.other is orig_other
    assert mod.call_target(1) == ("orig", 1, 1)


# ---------------------------------------------------------------- item 4: foreign wrappers

def foreign_wraps(fn):
    @functools.wraps(fn)
    def foreign(*args, **kwargs):
        return ("foreign", fn(*args, **kwargs))

    return foreign


def foreign_wrapt(module, attr):
    wrapt.wrap_function_wrapper(module, attr, lambda wrapped, instance, args, kwargs: ("foreign", wrapped(*args, **kwargs)))
    return getattr(module, attr)


@pytest.mark.parametrize("kind", ["functools.wraps", "wrapt"])
def test_revert_leaves_a_foreign_wrapper_in_place_logs_it_and_it_then_calls_the_original(lib, caplog, kind):
    pkg, mod, make_patch = lib
    core = sys.modules[f"{pkg}.core"]
    before = bindings(pkg)
    make_patch("t_outer_f", order=10)
    make_patch("t_inner_f", order=20)
    aiter_patches.apply(["t_outer_f", "t_inner_f"])
    if kind == "wrapt":
        foreign = foreign_wrapt(core, "target")
    else:
        foreign = core.target = foreign_wraps(core.target)
    assert core.target(1) == ("foreign", ("t_outer_f", ("t_inner_f", ("orig", 1, 1))))
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        assert registry.revert() == ["t_inner_f", "t_outer_f"]
    assert core.target is foreign, "the third party's wrapper was dropped"
    after = bindings(pkg)
    assert after["pkg.target"] is before["pkg.target"]
    assert after["consumer.imported_target"] is before["consumer.imported_target"]
    assert core.target(1) == ("foreign", ("orig", 1, 1)), "calls through it still ran a reverted patch"
    assert aiter_patches.stats()["t_outer_f"]["fast"] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{pkg}.core.target" in w and "left in place" in w for w in warned), warned


def test_applying_another_patch_on_the_target_keeps_a_foreign_wrapper(lib, caplog):
    pkg, mod, make_patch = lib
    core = sys.modules[f"{pkg}.core"]
    make_patch("t_first_g", order=10)
    make_patch("t_second_g", order=20)
    aiter_patches.apply(["t_first_g"])
    foreign = core.target = foreign_wraps(core.target)
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        aiter_patches.apply(["t_second_g"])
    assert core.target is foreign, "apply() of another patch dropped the third party's wrapper"
    assert any(f"{pkg}.core.target" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert sys.modules[pkg].target(1) == ("t_first_g", ("t_second_g", ("orig", 1, 1))), "our own aliases are rebuilt"
    assert core.target(1) == ("foreign", ("t_first_g", ("orig", 1, 1)))
    assert live_bindings("t_second_g")[f"{pkg}.core.target"] == "foreign"
    assert live_bindings("t_second_g")[f"{pkg}.target"] == "ours"
    registry.revert()
    assert core.target is foreign and core.target(1) == ("foreign", ("orig", 1, 1))


def test_a_reference_revert_cannot_see_calls_the_original_after_revert(lib):
    pkg, mod, make_patch = lib
    make_patch("t_captured")
    aiter_patches.apply(["t_captured"])
    table = {"moe": mod.target}  # a dispatch table: not a module-level binding
    registry.revert()
    assert table["moe"](1) == ("orig", 1, 1)
    aiter_patches.apply(["t_captured"])
    assert mod.target(1) == ("t_captured", ("orig", 1, 1)) and table["moe"](1) == ("orig", 1, 1)


# ---------------------------------------------------------------- item 5: apply() during another thread's import

SLOW_MODULE = '''
import sys
_gate = sys.modules[{gate!r}]
_gate.started.set()
_gate.proceed.wait(60)
from .core import Mode

def target(x, y=1, *, mode=Mode.A):
    return ("slow", x, y)
'''


@pytest.fixture
def slow_module(lib, tmp_path):
    pkg, mod, make_patch = lib
    gate = types.ModuleType("_aiter_patches_test_gate")
    gate.started, gate.proceed = threading.Event(), threading.Event()
    sys.modules[gate.__name__] = gate
    (tmp_path / pkg / "slow.py").write_text(SLOW_MODULE.format(gate=gate.__name__))
    importlib.invalidate_caches()
    p = Patch("t_slow", "slow import", (Target(f"{pkg}.slow", "target", (GOOD_PIN,), tagging("S")),))
    registry.register(p)
    yield pkg, gate
    gate.proceed.set()
    registry.unregister("t_slow")
    sys.modules.pop(gate.__name__, None)


@pytest.mark.parametrize("strict", [False, True])
def test_apply_during_another_threads_import_applies_once_it_completes(slow_module, strict):
    pkg, gate = slow_module
    errors = []

    def importer():
        try:
            importlib.import_module(f"{pkg}.slow")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=importer)
    t.start()
    assert gate.started.wait(30)
    report = aiter_patches.apply(["t_slow"], strict=strict)
    assert report.pending == ["t_slow"], report["t_slow"]
    gate.proceed.set()
    t.join(30)
    assert not t.is_alive() and not errors
    slow = sys.modules[f"{pkg}.slow"]
    assert wait_until(lambda: state("t_slow")["state"] == "applied"), state("t_slow")
    assert slow.target(1) == ("S", ("slow", 1, 1))
    registry.revert()
    assert slow.target(1) == ("slow", 1, 1)


def test_an_import_in_flight_that_fails_leaves_the_patch_pending_for_the_retry(slow_module, tmp_path):
    pkg, gate = slow_module
    path = tmp_path / pkg / "slow.py"
    path.write_text(path.read_text() + "\nraise RuntimeError('first import fails')\n")
    importlib.invalidate_caches()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, importlib.import_module,
                                                                    f"{pkg}.slow")))
    t.start()
    assert gate.started.wait(30)
    assert aiter_patches.apply(["t_slow"]).pending == ["t_slow"]
    gate.proceed.set()
    t.join(30)
    assert errors and f"{pkg}.slow" not in sys.modules
    assert wait_until(lambda: not core_state.watches.get(f"{pkg}.slow") or all(
        w.kind == "missing" for w in core_state.watches[f"{pkg}.slow"]))
    assert state("t_slow")["state"] == "pending"
    path.write_text(SLOW_MODULE.format(gate=gate.__name__))
    importlib.invalidate_caches()
    sys.modules.pop(f"{pkg}.slow", None)
    slow = importlib.import_module(f"{pkg}.slow")
    assert state("t_slow")["state"] == "applied" and slow.target(2) == ("S", ("slow", 2, 1))


# ---------------------------------------------------------------- item 6: strict mode and a retried import

def test_strict_skip_at_import_then_retry_status_describes_what_is_live(lib):
    pkg, mod, make_patch = lib
    make_patch("t_strict_good")
    make_patch("t_strict_bad", attr="other", pins=(Pin("old", "(x, z)"),))
    fakelib.forget(pkg)
    report = aiter_patches.apply(["t_strict_good", "t_strict_bad"], strict=True)
    assert sorted(report.pending) == ["t_strict_bad", "t_strict_good"]
    with pytest.raises(PatchSkipped, match="t_strict_bad"):
        importlib.import_module(pkg)
    assert pkg not in sys.modules and f"{pkg}.core" not in sys.modules
    assert state("t_strict_good")["state"] == "pending", "applied to a module object the failed import dropped"
    assert state("t_strict_bad")["state"] == "skipped"
    mod = importlib.import_module(pkg)  # the caller retries
    core = sys.modules[f"{pkg}.core"]
    assert state("t_strict_good")["state"] == "applied"
    assert getattr(core.target, "__aiter_patches__", None) == "t_strict_good"
    assert mod.target is core.target and mod.call_target(1) == ("t_strict_good", ("orig", 1, 1))
    assert not hasattr(core.other, "__aiter_patches__")
    registry.revert()
    assert mod.call_target(1) == ("orig", 1, 1)


class _RaisingFinder:
    """A third party's meta-path finder that raises something other than ImportError for one name."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise RuntimeError("fussy finder")
        return None


def _server_patch(name, requires):
    p = Patch(name, name, (Target(f"{requires}.layer", "f", (GOOD_PIN,), tagging(name, None)),), requires=requires)
    registry.register(p)
    return p


def test_a_finder_raising_for_a_servers_package_leaves_its_patch_inactive_and_apply_does_not_raise():
    finder = _RaisingFinder("_aiter_patches_test_server")
    sys.meta_path.insert(0, finder)
    _server_patch("t_fussy", "_aiter_patches_test_server")
    try:
        report = aiter_patches.apply(["t_fussy"], strict=False)
    finally:
        sys.meta_path.remove(finder)
        registry.unregister("t_fussy")
    assert report["t_fussy"]["state"] == "inactive"
    assert "is not installed" in report["t_fussy"]["reason"]


def test_a_bare_directory_named_like_a_servers_package_is_not_that_package_installed(tmp_path, monkeypatch):
    (tmp_path / "_aiter_patches_test_nsserver").mkdir()  # no __init__.py: a namespace package
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _server_patch("t_ns", "_aiter_patches_test_nsserver")
    try:
        report = aiter_patches.apply(["t_ns"], strict=False)
    finally:
        registry.unregister("t_ns")
    assert report["t_ns"]["state"] == "inactive", report["t_ns"]


def test_live_bindings_reads_a_class_method_target():
    """A ``Class.method`` target is reported as what the class holds now, not as missing."""
    mod = types.ModuleType("aiter_patches_test_class_target")

    class Layer:
        def forward(self, x):
            return ("orig", x)

    mod.Layer = Layer
    sys.modules[mod.__name__] = mod
    original = Layer.forward
    p = Patch(name="t_class_method", summary="class-method target",
              targets=(Target(mod.__name__, "Layer.forward", (Pin("v1", "(self, x)"),), tagging("t_class_method")),))
    registry.register(p)
    try:
        aiter_patches.apply(["t_class_method"])
        assert Layer().forward(1) == ("t_class_method", ("orig", 1))
        assert live_bindings("t_class_method") == {f"{mod.__name__}.Layer.forward": "ours"}
        Layer.forward = foreign_wraps(Layer.forward)
        assert live_bindings("t_class_method") == {f"{mod.__name__}.Layer.forward": "foreign"}
        Layer.forward = original
        assert live_bindings("t_class_method") == {f"{mod.__name__}.Layer.forward": "original"}
    finally:
        registry.revert(["t_class_method"])
        registry.unregister("t_class_method")
        sys.modules.pop(mod.__name__, None)
