"""The registry's contracts, on a small library built on disk (tests/registry/fakelib.py)."""

import importlib
import logging
import subprocess
import sys
import textwrap
import threading

import pytest

import aiter_patches
from aiter_patches import Patch, PatchSkipped, Pin, Target, registry

from . import fakelib

GOOD_PIN = Pin("v1", "(x, y=1, *, mode=Mode.A)", "fakelib core.py")


def tagging(tag, calls=None):
    """A wrapper factory whose wrapper tags the result, so the chain order is visible."""

    def factory(inner, site):
        if calls is not None:
            calls.append(tag)

        def wrapper(*args, **kwargs):
            site.counters.hit()
            return (tag, inner(*args, **kwargs))

        return wrapper

    return factory


@pytest.fixture
def lib(tmp_path):
    pkg = fakelib.make(tmp_path)
    mod = importlib.import_module(pkg)
    importlib.import_module(f"{pkg}.consumer")
    names = []

    def make_patch(name, *, attr="target", pins=(GOOD_PIN,), order=50, tag=None, calls=None, extra_targets=()):
        p = Patch(
            name=name,
            summary=f"test patch {name}",
            targets=(Target(f"{pkg}.core", attr, tuple(pins), tagging(tag or name, calls)), *extra_targets),
            order=order,
        )
        registry.register(p)
        names.append(name)
        return p

    yield pkg, mod, make_patch
    for n in names:
        registry.unregister(n)
    fakelib.forget(pkg)


def bindings(pkg):
    core = sys.modules[f"{pkg}.core"]
    return {
        "core.target": core.target,
        "pkg.target": sys.modules[pkg].target,
        "consumer.imported_target": sys.modules[f"{pkg}.consumer"].imported_target,
    }


def test_apply_rebinds_every_alias_and_revert_restores_identity(lib):
    pkg, mod, make_patch = lib
    make_patch("t_alias")
    before = bindings(pkg)
    report = aiter_patches.apply(["t_alias"])
    assert report.applied == ["t_alias"]
    after = bindings(pkg)
    assert len({id(v) for v in after.values()}) == 1, "all aliases point at one wrapper"
    assert after["core.target"] is not before["core.target"]
    # the module-global look-up (AITER's moe_sorting -> _moe_sorting_impl) reaches the wrapper
    assert mod.call_target(3) == ("t_alias", ("orig", 3, 1))
    rec = report["t_alias"]["targets"][0]
    assert rec["pin"] == "v1"
    assert set(rec["aliases"]) == {f"{pkg}.target", f"{pkg}.consumer.imported_target"}
    assert registry.revert(["t_alias"]) == ["t_alias"]
    restored = bindings(pkg)
    for k in before:
        assert restored[k] is before[k], k
    assert mod.call_target(3) == ("orig", 3, 1)


def test_module_imported_after_apply_is_restored_by_revert(lib, tmp_path):
    pkg, mod, make_patch = lib
    make_patch("t_late")
    orig = mod.target
    aiter_patches.apply(["t_late"])
    late = tmp_path / pkg / "late.py"
    late.write_text(f"from {pkg}.core import target as late_target\n")
    late_mod = importlib.import_module(f"{pkg}.late")
    assert late_mod.late_target is not orig
    aiter_patches.revert(["t_late"])
    assert late_mod.late_target is orig


def test_apply_is_idempotent(lib):
    pkg, mod, make_patch = lib
    calls = []
    make_patch("t_idem", calls=calls)
    aiter_patches.apply(["t_idem"])
    first = mod.target
    aiter_patches.apply(["t_idem"])
    aiter_patches.apply()  # all patches, including this one again
    assert mod.target is first
    assert mod.call_target(1) == ("t_idem", ("orig", 1, 1)), "no stacked wrapper"
    assert calls == ["t_idem"]


def test_concurrent_apply_applies_once(lib):
    pkg, mod, make_patch = lib
    calls = []
    make_patch("t_threads", calls=calls)
    barrier = threading.Barrier(16)
    errors = []

    def worker():
        try:
            barrier.wait()
            aiter_patches.apply(["t_threads"])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert calls == ["t_threads"]
    assert mod.call_target(2) == ("t_threads", ("orig", 2, 1))


def test_all_or_nothing_and_warning_names_the_difference(lib, caplog):
    pkg, mod, make_patch = lib
    orig_target, orig_other = mod.target, mod.other
    bad_second = Target(f"{pkg}.core", "other", (Pin("v1", "(x, z)"),), tagging("x"))
    make_patch("t_half", extra_targets=(bad_second,))
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        report = aiter_patches.apply(["t_half"])
    assert report.skipped == ["t_half"]
    assert mod.target is orig_target and mod.other is orig_other, "the matching target was not changed either"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0]
    assert "t_half" in msg and f"{pkg}.core.other" in msg
    assert "missing parameter 'z'" in msg
    assert report["t_half"]["reason"] in msg


@pytest.mark.parametrize(
    "pin_text, expected",
    [
        ("(x, y=2, *, mode=Mode.A)", "default of 'y' changed: 2 -> 1"),
        ("(y, x=1, *, mode=Mode.A)", "moved"),
        ("(x, y=1, *, mode=Mode.B)", "default of 'mode' changed: Mode.B -> Mode.A"),
        ("(x, y=1, *, mode=Mode.A, output=None)", "missing parameter 'output'"),
        ("(x, *, mode=Mode.A)", "extra parameter 'y=1'"),
        ("(x, y=1, mode=Mode.A)", "changed kind"),
    ],
)
def test_drift_is_described_exactly(lib, caplog, pin_text, expected):
    pkg, mod, make_patch = lib
    make_patch("t_drift", pins=(Pin("old", pin_text),))
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        report = aiter_patches.apply(["t_drift"])
    assert report.skipped == ["t_drift"]
    assert expected in report["t_drift"]["reason"]
    assert any(expected in r.getMessage() for r in caplog.records)


def test_any_of_several_pins_matches(lib):
    pkg, mod, make_patch = lib
    make_patch("t_multi", pins=(Pin("old", "(x)"), GOOD_PIN))
    report = aiter_patches.apply(["t_multi"])
    assert report["t_multi"]["targets"][0]["pin"] == "v1"


def test_missing_target_is_skipped_with_reason(lib):
    pkg, mod, make_patch = lib
    make_patch("t_missing", attr="nope")
    report = aiter_patches.apply(["t_missing"])
    assert report.skipped == ["t_missing"]
    assert report["t_missing"]["reason"] == f"{pkg}.core.nope is missing"


def test_opaque_custom_op_wrapper_is_declined_with_reason(lib):
    pkg, mod, make_patch = lib

    def opaque(*args, **kwargs):
        return None

    opaque.__name__ = "no_such_op_anywhere"
    mod_core = sys.modules[f"{pkg}.core"]
    mod_core.opaque = opaque
    make_patch("t_opaque", attr="opaque")
    report = aiter_patches.apply(["t_opaque"])
    assert report.skipped == ["t_opaque"]
    assert "custom-op wrapper" in report["t_opaque"]["reason"]


def test_strict_mode_raises(lib, monkeypatch):
    pkg, mod, make_patch = lib
    make_patch("t_strict", pins=(Pin("old", "(x)"),))
    with pytest.raises(PatchSkipped, match="t_strict"):
        aiter_patches.apply(["t_strict"], strict=True)
    registry.revert()
    aiter_patches.apply(["t_strict"], strict=False)
    monkeypatch.setenv("AITER_PATCHES_STRICT", "1")
    from aiter_patches import runtime

    runtime.set_strict(None)
    with pytest.raises(PatchSkipped):
        aiter_patches.apply(["t_strict"])


def test_env_disables_everything(lib, monkeypatch):
    pkg, mod, make_patch = lib
    make_patch("t_env")
    orig = mod.target
    monkeypatch.setenv("AITER_PATCHES", "0")
    report = aiter_patches.apply(["t_env"])
    assert report.disabled == ["t_env"]
    assert report["t_env"]["reason"] == "disabled by AITER_PATCHES=0"
    assert mod.target is orig


def test_env_disables_some_and_rejects_unknown_names(lib, monkeypatch):
    pkg, mod, make_patch = lib
    make_patch("t_env_a")
    make_patch("t_env_b", attr="other", pins=(Pin("v1", "(x)"),))
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "t_env_a")
    report = aiter_patches.apply(["t_env_a", "t_env_b"])
    assert report.disabled == ["t_env_a"] and report.applied == ["t_env_b"]
    monkeypatch.setenv("AITER_PATCHES_DISABLE", "t_env_a,typo_patch")
    with pytest.raises(ValueError, match="typo_patch.*known patches:.*t_env_a"):
        aiter_patches.apply(["t_env_a"])
    with pytest.raises(ValueError, match="unknown patch.*nonsense"):
        aiter_patches.apply(["nonsense"])


def test_chain_follows_declared_order_whatever_the_apply_order(lib):
    pkg, mod, make_patch = lib
    make_patch("t_inner", order=20)
    make_patch("t_outer", order=10)
    orig = mod.target
    aiter_patches.apply(["t_inner"])
    aiter_patches.apply(["t_outer"])
    assert mod.call_target(5) == ("t_outer", ("t_inner", ("orig", 5, 1)))
    consumer = sys.modules[f"{pkg}.consumer"]
    assert consumer.imported_target is mod.target, "aliases follow the chain head"
    registry.revert(["t_outer"])
    assert mod.call_target(5) == ("t_inner", ("orig", 5, 1))
    aiter_patches.apply(["t_outer"])
    registry.revert()  # both, outer first
    assert mod.target is orig and consumer.imported_target is orig


def test_status_and_stats_shapes(lib):
    pkg, mod, make_patch = lib
    make_patch("t_status")
    aiter_patches.apply(["t_status"])
    mod.call_target(1)
    mod.call_target(2)
    st = aiter_patches.status()
    assert set(st) >= {"aiter", "strict", "patches"}
    rec = next(r for r in st["patches"] if r["name"] == "t_status")
    assert rec["state"] == "applied"
    assert rec["targets"][0]["location"] == f"{pkg}.core.target"
    assert rec["targets"][0]["signature"] == "(x, y=1, *, mode=Mode.A)"
    assert rec["pins"] == {f"{pkg}.core.target": ["v1"]}
    s = aiter_patches.stats()["t_status"]
    assert s == {"fast": 2, "fallback": {}, "errors": {}, "checks_passed": 0, "checks_failed": 0}
    registry.revert()
    assert next(r for r in aiter_patches.status()["patches"] if r["name"] == "t_status")["state"] == "inactive"


def test_fast_path_error_falls_back_logs_once_and_strict_reraises(caplog):
    from aiter_patches import runtime
    from aiter_patches.runtime import PatchCounters

    c = PatchCounters("t_err")
    with caplog.at_level(logging.WARNING, logger="aiter_patches"):
        for _ in range(3):
            c.failed(RuntimeError("triton compile failed"), "kernel launch")
    assert c.snapshot()["errors"] == {"kernel launch: RuntimeError": 3}
    assert sum("triton compile failed" in r.getMessage() for r in caplog.records) == 1
    runtime.set_strict(True)
    with pytest.raises(RuntimeError, match="triton compile failed"):
        c.failed(RuntimeError("triton compile failed"), "kernel launch")


POST_IMPORT_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    import aiter_patches
    from aiter_patches import Patch, Pin, Target, registry

    def factory(inner, site):
        def wrapper(*a, **k):
            return ("patched", inner(*a, **k))
        return wrapper

    registry.register(Patch("t_hook", "hook test", (Target("{pkg}.core", "target", (Pin("v1", "(x, y=1, *, mode=Mode.A)"),), factory),)))
    report = aiter_patches.apply(["t_hook"])
    assert report.pending == ["t_hook"], report
    assert "{pkg}" not in sys.modules
    {body}
    """
)


@pytest.mark.parametrize(
    "body",
    [
        # apply() before import: the hook applies at import, the re-export alias included
        "import {pkg}\n"
        "assert {pkg}.call_target(1) == ('patched', ('orig', 1, 1))\n"
        "assert {pkg}.target is sys.modules['{pkg}.core'].target\n"
        "assert registry.status()['patches'][-1]['state'] == 'applied'\n"
        "registry.revert()\n"
        "assert {pkg}.call_target(1) == ('orig', 1, 1)\n"
        "print('OK')",
        # revert() before import cancels the pending hook
        "registry.revert()\n"
        "import {pkg}\n"
        "assert {pkg}.call_target(1) == ('orig', 1, 1)\n"
        "print('OK')",
    ],
    ids=["applies-at-import", "revert-cancels-hook"],
)
def test_post_import_hook_in_fresh_process(tmp_path, body):
    pkg = fakelib.make(tmp_path)
    fakelib.forget(pkg)
    script = POST_IMPORT_SCRIPT.format(root=str(tmp_path), pkg=pkg, body=body.format(pkg=pkg))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")
