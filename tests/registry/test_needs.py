"""Declared needs (``Patch.needs``, ``Patch.pending_ok``, ``Site.below``, ``Site.needs_unmet``): core/needs.py's rule."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

import aiter_patches
from aiter_patches import Patch, Pin, Target, registry

PIN = Pin("v1", "(x)", "test")


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Modules written on disk (imported when a test says so) and patches on them, unregistered dependents first."""
    monkeypatch.syspath_prepend(str(tmp_path))
    tag = uuid.uuid4().hex[:8]
    made: list[str] = []
    modules: list[str] = []

    def module(short: str, body: str = "def f(x):\n    return ('orig', x)\n", *, imported: bool = True) -> str:
        name = f"needs_{short}_{tag}"
        (tmp_path / f"{name}.py").write_text(body)
        modules.append(name)
        if imported:
            importlib.import_module(name)
        return name

    def patch(short: str, mod: str, *, needs=(), pending_ok=(), order=50, pins=(PIN,), seen=None) -> str:
        name = f"{short}_{tag}"

        def factory(inner, site):
            if seen is not None:
                seen.append((name, site.below, site.needs_unmet()))

            def wrapper(x):
                return (name, inner(x))

            return wrapper

        registry.register(Patch(name, f"test {short}", (Target(mod, "f", pins, factory),), order=order,
                                needs=tuple(f"{n}_{tag}" for n in needs),
                                pending_ok=tuple(f"{n}_{tag}" for n in pending_ok)))
        made.append(name)
        return name

    yield module, patch
    registry.revert()
    for name in reversed(made):
        registry.unregister(name)
    for name in modules:
        sys.modules.pop(name, None)


def states(*names: str) -> dict[str, tuple[str, str]]:
    recs = {p["name"]: p for p in aiter_patches.status()["patches"]}
    return {n: (recs[n]["state"], recs[n]["reason"]) for n in names}


def test_register_refuses_unknown_needs_a_cycle_and_pending_ok_outside_needs(world):
    module, patch = world
    m = module("m")
    with pytest.raises(ValueError, match="needs unknown patch"):
        registry.register(Patch("n_unknown", "s", (Target(m, "f", (PIN,), lambda f, s: f),), needs=("nope",)))
    with pytest.raises(ValueError, match="cycle"):
        registry.register(Patch("n_self", "s", (Target(m, "f", (PIN,), lambda f, s: f),), needs=("n_self",)))
    a = patch("a", m)
    b = patch("b", m, needs=("a",))
    with pytest.raises(ValueError, match=f"cycle: {a} -> {b} -> {a}"):  # a re-declared to need b
        registry.register(Patch(a, "s", (Target(m, "f", (PIN,), lambda f, s: f),), needs=(b,)))
    with pytest.raises(ValueError, match="pending_ok names"):
        registry.register(Patch("n_stray", "s", (Target(m, "f", (PIN,), lambda f, s: f),), pending_ok=(a,)))
    with pytest.raises(ValueError, match=f"patch '{a}' is needed by {b}"):
        registry.unregister(a)


def test_applying_a_dependent_applies_its_need_first(world):
    module, patch = world
    m = module("m")
    seen: list = []
    inner = patch("inner", m, order=60, seen=seen)
    outer = patch("outer", m, order=10, needs=("inner",), seen=seen)
    report = aiter_patches.apply([outer])
    assert list(report) == [outer] and report.applied == [outer]
    assert states(inner) == {inner: ("applied", "")}
    # the need's wrapper was built first, then the dependent's over it, told whose layer it wraps
    assert seen == [(inner, None, None), (outer, inner, None)]
    assert sys.modules[m].f(1) == (outer, (inner, ("orig", 1)))


def test_a_disabled_or_skipped_need_skips_its_dependent_with_the_need_s_reason(world, monkeypatch):
    module, patch = world
    m = module("m")
    need = patch("need", m)
    drifted = patch("drifted", m, pins=(Pin("v0", "(x, y)", "test"),))
    d1 = patch("d1", m, needs=("need",))
    d2 = patch("d2", m, needs=("drifted",))
    monkeypatch.setenv("AITER_PATCHES_DISABLE", need)
    aiter_patches.apply([d1, d2])
    skip_reason = states(drifted)[drifted][1]
    assert states(need, d1, d2) == {
        need: ("disabled", "disabled by AITER_PATCHES_DISABLE"),
        d1: ("skipped", f"needs {need}, which is disabled: disabled by AITER_PATCHES_DISABLE"),
        d2: ("skipped", f"needs {drifted}, which is skipped: {skip_reason}"),
    }
    assert sys.modules[m].f(1) == ("orig", 1)


def test_a_dependent_waits_for_a_pending_need_and_applies_in_the_same_pass(world):
    module, patch = world
    later = module("later", imported=False)
    now = module("now")
    need = patch("need", later)
    dep = patch("dep", now, needs=("need",))
    aiter_patches.apply([dep])
    assert states(need, dep) == {need: ("pending", f"waiting for import of {later}"),
                                 dep: ("pending", f"waiting for {need}")}
    importlib.import_module(later)  # no second apply(): the need's import hook applies both
    assert states(need, dep) == {need: ("applied", ""), dep: ("applied", "")}
    assert sys.modules[now].f(1) == (dep, ("orig", 1))


def test_reverting_a_need_reverts_its_dependents_first(world):
    module, patch = world
    m = module("m")
    need = patch("need", m, order=60)
    dep = patch("dep", m, order=10, needs=("need",))
    aiter_patches.apply([dep])
    assert registry.revert([need]) == [dep, need]
    assert states(need, dep) == {need: ("inactive", "reverted"), dep: ("inactive", f"reverted with {need}, which it needs")}
    assert sys.modules[m].f(1) == ("orig", 1)
    aiter_patches.apply([need, dep])
    assert states(need, dep) == {need: ("applied", ""), dep: ("applied", "")}
    assert registry.revert() == [dep, need]  # everything: reverse apply order


def test_disabling_a_need_later_takes_its_dependent_off(world, monkeypatch):
    module, patch = world
    m = module("m")
    need = patch("need", m)
    dep = patch("dep", m, needs=("need",))
    aiter_patches.apply([dep])
    monkeypatch.setenv("AITER_PATCHES_DISABLE", need)
    aiter_patches.apply([dep])
    assert states(need, dep) == {
        need: ("disabled", "disabled by AITER_PATCHES_DISABLE"),
        dep: ("skipped", f"needs {need}, which is disabled: disabled by AITER_PATCHES_DISABLE")}
    assert sys.modules[m].f(1) == ("orig", 1)


def test_pending_ok_applies_ahead_and_asks_its_site_at_call_time(world):
    module, patch = world
    later = module("later", imported=False)
    now = module("now")
    need = patch("need", later)
    sites = []

    def factory(inner, site):
        sites.append(site)

        def wrapper(x):
            return ("ahead", site.needs_unmet(), inner(x))

        return wrapper

    ahead = f"ahead_{need.rsplit('_', 1)[1]}"
    registry.register(Patch(ahead, "s", (Target(now, "f", (PIN,), factory),), needs=(need,), pending_ok=(need,)))
    try:
        aiter_patches.apply([ahead])
        assert states(need, ahead) == {need: ("pending", f"waiting for import of {later}"), ahead: ("applied", "")}
        assert sys.modules[now].f(1) == ("ahead", f"{need} is pending", ("orig", 1))
        importlib.import_module(later)
        assert sys.modules[now].f(1) == ("ahead", None, ("orig", 1))
    finally:
        registry.revert([ahead])
        registry.unregister(ahead)


def test_a_need_skipped_at_its_import_takes_off_what_was_applied_ahead_of_it(world):
    module, patch = world
    later = module("later", "def f(x, y):\n    return x\n", imported=False)  # will not match the pin
    now = module("now")
    need = patch("need", later)
    ahead = patch("ahead", now, needs=("need",), pending_ok=("need",))
    aiter_patches.apply([ahead])
    assert states(ahead)[ahead] == ("applied", "")
    importlib.import_module(later)
    need_reason = states(need)[need][1]
    assert states(need, ahead) == {need: ("skipped", need_reason),
                                   ahead: ("skipped", f"needs {need}, which is skipped: {need_reason}")}
    assert sys.modules[now].f(1) == ("orig", 1)


def test_site_below_names_the_layer_directly_under(world):
    module, patch = world
    m = module("m")
    seen: list = []
    top = patch("top", m, order=10, seen=seen)
    mid = patch("mid", m, order=20, seen=seen)
    aiter_patches.apply([top])
    aiter_patches.apply([mid])  # built under top: top's wrapper is rebuilt over mid's
    assert seen == [(top, None, None), (mid, None, None), (top, mid, None)]


def test_an_apply_report_prints_one_line_per_patch(world, monkeypatch):
    module, patch = world
    m = module("m")
    a = patch("a", m)
    b = patch("b", m, needs=("a",))
    monkeypatch.setenv("AITER_PATCHES_DISABLE", a)
    report = aiter_patches.apply([a, b])
    assert report.disabled == [a] and report.skipped == [b]  # a dict with its properties still
    text = f"{a}: disabled (disabled by AITER_PATCHES_DISABLE)\n" \
           f"{b}: skipped (needs {a}, which is disabled: disabled by AITER_PATCHES_DISABLE)"
    assert repr(report) == str(report) == text
    monkeypatch.delenv("AITER_PATCHES_DISABLE")
    assert str(aiter_patches.apply([a])) == f"{a}: applied"
