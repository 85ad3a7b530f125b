"""The registry: the only code that changes AITER's namespaces.

A patch is declared (``declarations.py``: its targets, the signatures it accepts,
a wrapper factory); the registry performs it: all or nothing per patch, only when every target's
signature matches a pin, at once or the moment AITER's module is imported, on
every module-level alias of the original, chained with other patches on the
same target in declared order, idempotent, thread-safe, and exactly revertible.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

# Everything the registry calls is imported here, never inside a call: an import running in one thread
# when another forks leaves that module locked for good in the child.
from . import env_flags, foreign_layers, import_hooks, process_report, runtime, stats_log
from .declarations import (  # re-exported: `from aiter_patches.registry import Patch` and the rest keep working
    APPLIED,
    DISABLED,
    INACTIVE,
    PENDING,
    SKIPPED,
    Patch,
    PatchSkipped,
    Site,
    SourcePin,
    Target,
)
from .integrations import switch as integrations_switch
from .runtime import PatchCounters
from .signatures import Binder, Pin, SignatureUnavailable, from_callable, match

log = logging.getLogger("aiter_patches")


@dataclass
class _Layer:
    patch: Patch
    target: Target
    site: Site
    fn: Callable | None = None  # the wrapper last built for this layer
    over: Callable | None = None  # what ``fn`` wraps
    built: list[tuple[Any, Callable]] = field(default_factory=list)  # (weakref to a wrapper, what it wraps)


@dataclass
class _Chain:
    module: str
    attr: str
    original: Callable
    layers: list[_Layer] = field(default_factory=list)
    current: Callable | None = None
    locations: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class _State:
    state: str = INACTIVE
    reason: str = ""
    targets: list[dict[str, Any]] = field(default_factory=list)


_lock = threading.RLock()
_patches: dict[str, Patch] = {}
_states: dict[str, _State] = {}
_counters: dict[str, PatchCounters] = {}
_chains: dict[tuple[str, str], _Chain] = {}
# owner patch -> (module, name, the foreign wrapper unwrap_foreign took off there, what it put there, AITER's object)
_unwrapped: dict[str, list[tuple[str, str, Callable, Callable, Callable]]] = {}
_watches: dict[str, list[import_hooks.Watch]] = {}  # module name -> what waits for it, while a patch is pending on it
_builtins_loaded = False


# ---------------------------------------------------------------- declaration

def register(patch: Patch) -> Patch:
    """Declare a patch. Re-registering the same name replaces an inactive declaration."""
    with _lock:
        old = _states.get(patch.name)
        if old is not None and old.state in (APPLIED, PENDING):
            raise ValueError(f"patch '{patch.name}' is {old.state}; revert it before re-registering")
        _patches[patch.name] = patch
        _states[patch.name] = _State()
        _counters.setdefault(patch.name, PatchCounters(patch.name))
    return patch


def unregister(name: str) -> None:
    with _lock:
        if name in _states and _states[name].state in (APPLIED, PENDING):
            _revert_one(name)
        _patches.pop(name, None)
        _states.pop(name, None)
        _counters.pop(name, None)


def _ensure_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _lock:  # the import under the lock: fork() waits for it (see _before_fork)
        if _builtins_loaded:
            return
        from .patches import BUILTIN_PATCHES  # imports nothing of AITER

        for p in BUILTIN_PATCHES:
            if p.name not in _patches:
                register(p)
        _builtins_loaded = True


def patches() -> list[Patch]:
    _ensure_builtins()
    with _lock:
        return sorted(_patches.values(), key=lambda p: (p.order, p.name))


# ---------------------------------------------------------------- environment

def _env_disabled(known: Sequence[str]) -> tuple[set[str], str]:
    """Names disabled by the environment, and the reason text; raises on unknown names."""
    if env_flags.env_false("AITER_PATCHES"):
        return set(known), "AITER_PATCHES=0"
    raw = os.environ.get("AITER_PATCHES_DISABLE", "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(
            f"AITER_PATCHES_DISABLE names unknown patch(es) {', '.join(unknown)}; "
            f"known patches: {', '.join(known)}"
        )
    return names, "AITER_PATCHES_DISABLE"


def _check_names(names: Iterable[str] | None, known: Sequence[str], what: str) -> list[str]:
    if names is None:
        return list(known)
    if isinstance(names, str):
        names = [names]
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown patch(es) {', '.join(unknown)}; known patches: {', '.join(known)}")
    return names


# ---------------------------------------------------------------- apply

class ApplyReport(dict):
    """``{patch name: status record}`` for the patches an ``apply()`` call was about."""

    def _names(self, state: str) -> list[str]:
        return [n for n, r in self.items() if r["state"] == state]

    @property
    def applied(self) -> list[str]:
        return self._names(APPLIED)

    @property
    def skipped(self) -> list[str]:
        return self._names(SKIPPED)

    @property
    def pending(self) -> list[str]:
        return self._names(PENDING)

    @property
    def disabled(self) -> list[str]:
        return self._names(DISABLED)


def apply(names: Iterable[str] | None = None, *, strict: bool | None = None) -> ApplyReport:
    """Apply patches (all by default) now, or when AITER's modules get imported.

    Returns the status record of each requested patch. Unknown names, in
    ``names`` or in ``AITER_PATCHES_DISABLE``, raise ``ValueError``; nothing
    else raises outside strict mode.
    """
    all_patches = patches()
    known = [p.name for p in all_patches]
    requested = _check_names(names, known, "apply()")
    disabled, why = _env_disabled(known)
    off = integrations_switch.not_switched_on(all_patches)
    if strict is not None:
        runtime.set_strict(strict)
    with _lock:
        for p in all_patches:
            if p.name not in requested:
                continue
            st = _states[p.name]
            if p.name in disabled or p.name in off:
                if st.state in (APPLIED, PENDING):
                    _revert_one(p.name)
                st.state, st.reason = DISABLED, f"disabled by {why}" if p.name in disabled else off[p.name]
                continue
            if st.state in (APPLIED, PENDING):
                continue  # idempotent: nothing stacks
            _apply_or_defer(p)
        report = ApplyReport((n, _record(n)) for n in known if n in requested)
    process_report.log_if_changed()
    return report


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported here (a patch on a server's code is inactive where it is not)."""
    if package in sys.modules:
        return True
    try:
        spec = importlib.util.find_spec(package)
    except Exception as exc:  # a third party's finder may raise anything: apply() never does outside strict mode
        log.debug("aiter_patches: looking for %s raised %s: %s; taken as not installed", package,
                  type(exc).__name__, exc)
        return False
    # a bare directory of that name on sys.path is a namespace package (no origin): not the server's package
    return spec is not None and spec.origin is not None


def _target_modules(p: Patch) -> list[str]:
    return list(p.modules)


def _apply_or_defer(p: Patch, just_executed: str | None = None) -> None:
    """Apply now if every module of the patch has finished executing, else wait for the ones that have not.

    A module in ``sys.modules`` may still be running its code in another
    thread, or be a lazy module that has not run it: both are waited for,
    never treated as missing targets, and never executed here.
    """
    if p.requires is not None and not _installed(p.requires):
        st = _states[p.name]
        st.state, st.reason, st.targets = INACTIVE, f"{p.requires} is not installed", []
        return
    waiting = {}
    for m in _target_modules(p):
        r = import_hooks.READY if m == just_executed else import_hooks.readiness(m)
        if r != import_hooks.READY:
            waiting[m] = r
    if not waiting:
        _try_apply(p)
        return
    st = _states[p.name]
    st.state, st.reason, st.targets = PENDING, f"waiting for import of {', '.join(waiting)}", []
    for m, r in waiting.items():
        _watch(m, r)


def _watch(module: str, readiness: str) -> None:
    """Be called back when ``module`` is ready: at its next import, and, if it is being imported or lazy now, then."""
    watches = [w for w in _watches.get(module, []) if w.active]
    kinds = {w.kind for w in watches}
    try:
        if import_hooks.MISSING not in kinds:  # also the retry of an import that fails
            watches.append(import_hooks.when_imported(module, _module_event))
        if readiness == import_hooks.INITIALIZING and readiness not in kinds:
            watches.append(import_hooks.when_initialized(module, _module_event))
        elif readiness == import_hooks.LAZY and readiness not in kinds:
            watches.append(import_hooks.when_loaded_lazily(module, _module_event))
    except Exception as exc:  # e.g. no thread can be started: the patch stays pending, apply() goes on
        log.warning("aiter_patches: cannot watch the import of %s: %s: %s", module, type(exc).__name__, exc)
    _watches[module] = watches


def _unwatch_unused() -> None:
    needed = {m for n, st in _states.items() if st.state == PENDING for m in _target_modules(_patches[n])}
    for module in [m for m in _watches if m not in needed]:
        for w in _watches.pop(module):
            w.cancel()


def _module_event(module: str, during_import: bool) -> None:
    """A watched module finished executing (``during_import``: we are inside its import), or its import ended.

    In strict mode a patch that cannot apply raises ``PatchSkipped`` here,
    which fails that import: importlib then drops the module object, so the
    patches applied to it in this same pass are taken off again and wait for
    the caller's next import of it, and ``status()`` stays true to what is live.
    """
    errors: list[PatchSkipped] = []
    with _lock:
        for w in _watches.pop(module, []):
            w.cancel()
        applied: list[str] = []
        for p in sorted(_patches.values(), key=lambda q: (q.order, q.name)):
            if _states[p.name].state != PENDING or module not in _target_modules(p):
                continue
            try:
                _apply_or_defer(p, just_executed=module if during_import else None)
            except PatchSkipped as exc:
                errors.append(exc)
                continue
            except Exception:  # never fail the user's import outside strict mode
                log.exception("aiter_patches: applying '%s' after the import of %s raised", p.name, module)
                continue
            if _states[p.name].state == APPLIED:
                applied.append(p.name)
        if errors and during_import:
            for name in reversed(applied):
                _revert_one(name)
                _apply_or_defer(_patches[name])  # pending again: the failed import left no module
            _watch(module, import_hooks.MISSING)
    process_report.log_if_changed()
    if errors:
        raise errors[0]


_MISSING = object()


def _dotted_owner(mod: Any, attr: str) -> tuple[Any, str]:
    """The object holding a target's last name: the module, or a class in it for ``"Class.method"`` targets."""
    *owners, name = attr.split(".")
    for part in owners:
        mod = getattr(mod, part, None) if mod is not None else None
    return mod, name


def _get_dotted(mod: Any, attr: str) -> Any:
    owner, name = _dotted_owner(mod, attr)
    return _MISSING if owner is None else getattr(owner, name, _MISSING)


def _check_targets(p: Patch, records: list[dict[str, Any]]) -> tuple[str | None, list[tuple[Target, Callable, Pin]]]:
    """Every target present, callable and matching a pin: (None, found), else (the reason, [])."""
    found: list[tuple[Target, Callable, Pin]] = []
    for t in p.targets:
        mod = sys.modules.get(t.module)
        obj = _get_dotted(mod, t.attr) if mod is not None else _MISSING
        chain = _chains.get((t.module, t.attr))
        original = chain.original if chain is not None else obj
        rec: dict[str, Any] = {"location": t.location, "signature": None, "pin": None, "aliases": []}
        records.append(rec)
        if original is _MISSING:
            return f"{t.location} is missing", []
        if not callable(original):
            return f"{t.location} is not callable ({type(original).__name__})", []
        try:
            sig = from_callable(original, op_names=(t.attr.rpartition(".")[2],))
        except SignatureUnavailable as exc:
            return f"{t.location}: cannot read its signature: {exc}", []
        rec["signature"] = str(sig)
        pin, differences = match(sig, t.pins)
        if pin is None:
            accepted = ", ".join(x.label for x in t.pins)
            return f"{t.location} signature drifted ({'; '.join(differences)}); accepted pins: {accepted}", []
        rec["pin"] = pin.label
        if p.precheck is not None:
            try:
                problem = p.precheck(t, original)
            except Exception as exc:  # a gate that cannot decide does not apply the patch
                problem = f"its precheck raised {type(exc).__name__}: {exc}"
            if problem is not None:
                return f"{t.location}: {problem}", []
        found.append((t, original, pin))
    return None, found


def _try_apply(p: Patch) -> None:
    """All or nothing: check every target, build every wrapper, then bind them; any failure changes nothing."""
    st = _states[p.name]
    records: list[dict[str, Any]] = []
    try:
        problem, found = _check_targets(p, records)
        if problem is None:
            problem = _install(p, found, records)
    except Exception as exc:  # an AITER object that raises on inspection: skip this patch, never fail apply()
        log.debug("aiter_patches: applying '%s' raised", p.name, exc_info=True)
        problem = f"applying raised {type(exc).__name__}: {exc}"
    if problem is not None:
        st.state, st.reason, st.targets = SKIPPED, problem, records
        log.warning("aiter_patches: skipped patch '%s': %s", p.name, problem)
        if runtime.strict():
            raise PatchSkipped(f"patch '{p.name}' skipped: {problem}")
        return
    st.state, st.reason, st.targets = APPLIED, "", records
    pins = ", ".join(f"{r['location']} @ {r['pin']}" for r in records)
    log.info("aiter_patches: applied '%s' (%s) to %s", p.name, p.summary, pins)
    if p.after_apply is not None:
        sites = [(l.site, c.original) for t, _, _ in found for c in [_chains[(t.module, t.attr)]]
                 for l in c.layers if l.patch.name == p.name]
        try:
            p.after_apply(sites)
        except Exception:  # the patch is applied; its follow-up step failed and says so
            log.warning("aiter_patches: the step after applying '%s' raised", p.name, exc_info=True)


def _install(p: Patch, found: list[tuple[Target, Callable, Pin]], records: list[dict[str, Any]]) -> str | None:
    """Add the patch's layer to each target's chain; on any exception undo the targets done so far."""
    counters = _counters[p.name]
    plans = []
    for t, original, pin in found:  # build first: a wrapper factory that raises leaves no trace
        chain = _chains.get((t.module, t.attr)) or _Chain(t.module, t.attr, original)
        layer = _Layer(p, t, Site(p, t, pin, Binder(pin.signature), counters))
        layers = _ordered([*chain.layers, layer])
        try:
            head, builds = _compose(chain.original, layers)
        except Exception as exc:
            return f"{t.location}: the wrapper factory raised {type(exc).__name__}: {exc}"
        plans.append((chain, layers, head, builds))
    done: list[tuple[_Chain, list[_Layer], Callable | None]] = []
    for (chain, layers, head, builds), rec in zip(plans, records):
        before = (chain, list(chain.layers), chain.current)
        try:
            _commit(chain, layers, head, builds)
            done.append(before)
            _bind(chain, before[2], head, strict_home=True)
        except Exception as exc:
            for old_chain, old_layers, old_head in reversed(done):
                _restore(old_chain, old_layers, old_head)
            return f"{chain.module}.{chain.attr}: binding the wrapper raised {type(exc).__name__}: {exc}"
        rec["aliases"] = sorted(f"{m}.{a}" for m, a in chain.locations if (m, a) != (chain.module, chain.attr))
    return None


# ---------------------------------------------------------------- chains and aliases

def _ordered(layers: list[_Layer]) -> list[_Layer]:
    return sorted(layers, key=lambda l: (l.patch.order, l.patch.name))


def _compose(original: Callable, layers: list[_Layer]) -> tuple[Callable, list[tuple[_Layer, Callable, Callable]]]:
    """The chain head over ``original``, outer layers first; layers whose inner is unchanged are reused."""
    fn = original
    builds: list[tuple[_Layer, Callable, Callable]] = []
    for layer in reversed(layers):
        if layer.fn is not None and layer.over is fn:
            fn = layer.fn
            continue
        wrapped = layer.target.wrap(fn, layer.site)
        if wrapped is not fn:  # a factory that hands back its inner adds no layer: nothing to mark or disarm
            _mark(wrapped, layer.patch.name, fn)
        builds.append((layer, wrapped, fn))
        fn = wrapped
    return fn, builds


def _commit(chain: _Chain, layers: list[_Layer], head: Callable, builds) -> None:
    for layer, fn, over in builds:
        layer.fn, layer.over = fn, over
        layer.built = [(r, o) for r, o in layer.built if r() is not None]
        if fn is over:
            continue
        try:
            layer.built.append((weakref.ref(fn), over))
        except TypeError:  # not weak-referenceable: cannot be disarmed at revert either
            pass
    chain.layers = layers
    chain.current = head if layers else None
    if layers:
        _chains[(chain.module, chain.attr)] = chain
    else:
        _chains.pop((chain.module, chain.attr), None)


def _restore(chain: _Chain, layers: list[_Layer], head: Callable | None) -> None:
    """Undo a commit + bind of this apply(): the chain's layers and its bindings as they were."""
    new_head = chain.current
    chain.layers = layers
    chain.current = head
    if layers:
        _chains[(chain.module, chain.attr)] = chain
    else:
        _chains.pop((chain.module, chain.attr), None)
    if new_head is not None:
        _bind(chain, new_head, head if head is not None else chain.original)


def _mark(wrapper: Callable, patch_name: str, inner: Callable) -> None:
    try:
        wrapper.__aiter_patches__ = patch_name  # type: ignore[attr-defined]
        if not hasattr(wrapper, "__wrapped__"):
            wrapper.__wrapped__ = inner  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass


def _bind(chain: _Chain, old_head: Callable | None, new: Callable, *, strict_home: bool = False) -> None:
    """Point every module-level binding of ``old_head`` (and of the original, unless reverting to it) at ``new``.

    Only bindings that hold one of our own objects, by identity, change. A
    location we bound earlier that now holds something else was rebound by a
    third party (its own wrapper, usually around ours): it is left in place,
    with a WARNING naming it.
    """
    reverting = new is chain.original
    old_ids = {id(old_head)} if old_head is not None else set()
    if not reverting:
        old_ids.add(id(chain.original))
    home, name = _dotted_owner(sys.modules.get(chain.module), chain.attr)
    if home is not None:
        held = getattr(home, name, _MISSING)
        if id(held) in old_ids:
            try:
                setattr(home, name, new)
            except Exception:
                if strict_home:
                    raise
                log.warning("aiter_patches: could not rebind %s.%s", chain.module, chain.attr, exc_info=True)
            else:
                chain.locations.add((chain.module, chain.attr))
    chain.locations |= _rebind(old_ids, new)
    for mod_name, attr in sorted(chain.locations):
        d = import_hooks.module_dict(sys.modules.get(mod_name))
        held = d.get(attr, _MISSING) if d is not None else _MISSING
        if held is new or held is _MISSING or held is chain.original:
            continue
        what = f"a {type(held).__name__} {getattr(held, '__qualname__', '')}".rstrip()
        log.warning("aiter_patches: %s.%s holds %s, bound there by someone else after aiter_patches; left in place: "
                    "calls through it reach only the patches applied when it was bound, and none once reverted",
                    mod_name, attr, what)
    if reverting:
        chain.locations = set()


def _rebind(old_ids: set[int], new: Callable) -> set[tuple[str, str]]:
    """Point every module-level binding of an old object at ``new``; returns the locations changed.

    Modules are read through their raw ``__dict__``: a lazily loaded module is
    never executed by this scan, and a module that cannot be read is skipped.
    """
    changed: set[tuple[str, str]] = set()
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("aiter_patches.") and not mod_name.startswith("aiter_patches.stub_aiter"):
            continue
        d = import_hooks.module_dict(mod)
        if d is None:
            continue
        try:
            items = [(k, v) for k, v in list(d.items()) if id(v) in old_ids]
        except Exception:  # dict changed size under a concurrent import, or a hostile key
            continue
        for k, v in items:
            if d.get(k) is v:
                d[k] = new
                changed.add((mod_name, k))
    return changed


# ---------------------------------------------------------------- disarming a reverted wrapper

_PASSTHROUGH_ARG = "__aiter_patches_call__"
_passthrough_codes: dict[int, types.CodeType] = {}


def _passthrough_code(nfree: int) -> types.CodeType:
    """Code that calls ``__aiter_patches_call__`` (a keyword default) with its arguments, for a function with ``nfree`` closure cells."""
    code = _passthrough_codes.get(nfree)
    if code is None:
        names = [f"_cell{i}" for i in range(nfree)]
        src = "def _outer():\n" + "".join(f"    {n} = None\n" for n in names)
        src += f"    def passthrough(*args, {_PASSTHROUGH_ARG}=None, **kwargs):\n"
        if names:  # never called: makes the cells free variables of passthrough, so the closure still fits
            src += f"        lambda: ({', '.join(names)},)\n"
        src += f"        return {_PASSTHROUGH_ARG}(*args, **kwargs)\n    return passthrough\n"
        ns: dict[str, Any] = {}
        exec(compile(src, "<aiter_patches passthrough>", "exec"), ns)
        code = _passthrough_codes[nfree] = ns["_outer"]().__code__
    return code


def _disarm(layer: _Layer) -> list[str]:
    """Make every wrapper built for a reverted layer pass its calls to what it wraps; returns the ones that could not be.

    Revert unbinds our wrappers everywhere it can see (module-level names).
    A reference it cannot see (a third party's wrapper around ours, a
    dispatch table, a captured local) would still run the patch: swapping
    the wrapper's code in place for a pass-through makes those calls take the
    original's path too, at no cost to calls made while the patch is applied.
    """
    failed = []
    originals = {id(c.original) for c in _chains.values()}
    for ref, over in layer.built:
        fn = ref()
        if fn is None or fn is over or id(fn) in originals or getattr(fn, "__aiter_patches__", None) is None:
            continue
        try:
            if type(fn) is not types.FunctionType:
                raise TypeError(f"a {type(fn).__name__}, not a function")
            code = _passthrough_code(len(fn.__closure__ or ()))
            # the defaults first: a call between the two assignments must find its keyword default (free-threaded builds)
            kwdefaults = fn.__kwdefaults__
            fn.__kwdefaults__ = {**(kwdefaults or {}), _PASSTHROUGH_ARG: over}
            try:
                fn.__code__ = code
            except BaseException:
                fn.__kwdefaults__ = kwdefaults
                raise
            fn.__aiter_patches_reverted__ = fn.__dict__.pop("__aiter_patches__", layer.patch.name)
        except Exception as exc:
            failed.append(f"{getattr(fn, '__qualname__', fn)!s}: {exc}")
    layer.built = []
    layer.fn = layer.over = None
    return failed


# ---------------------------------------------------------------- revert

def revert(names: Iterable[str] | None = None) -> list[str]:
    """Take patches off (all by default), in reverse of declared order; cancel pending hooks.

    Every binding the registry changed that still holds its object gets the
    exact original back; a binding a third party changed since is left alone
    (logged), and the wrappers it may hold pass every call to the original.
    Returns the names that were reverted.
    """
    all_patches = patches()
    known = [p.name for p in all_patches]
    requested = _check_names(names, known, "revert()")
    done: list[str] = []
    with _lock:
        for p in reversed(all_patches):
            if p.name in requested and _states[p.name].state in (APPLIED, PENDING):
                _revert_one(p.name)
                done.append(p.name)
    return done


def _revert_one(name: str) -> None:
    st = _states[name]
    was = st.state
    st.state, st.reason, st.targets = INACTIVE, "reverted", []
    _unwatch_unused()
    if was != APPLIED:
        return
    _rewrap_foreign(name)
    casualties: list[str] = []
    for chain in list(_chains.values()):
        mine = [l for l in chain.layers if l.patch.name == name]
        if not mine:
            continue
        rest = [l for l in chain.layers if l.patch.name != name]
        old_head = chain.current
        try:
            head, builds = _compose(chain.original, rest)
        except Exception as exc:  # a factory that worked before raised now: take its patches off this target too
            log.warning("aiter_patches: rebuilding %s.%s without '%s' raised %s: %s; the patches left on it are "
                        "taken off", chain.module, chain.attr, name, type(exc).__name__, exc)
            casualties += [l.patch.name for l in rest]
            mine, rest, head, builds = chain.layers, [], chain.original, []
        _commit(chain, rest, head, builds)
        _bind(chain, old_head, head)
        for layer in mine:
            for problem in _disarm(layer):
                log.warning("aiter_patches: reverted '%s' but could not disarm %s; a reference to it that revert "
                            "cannot see still runs the patch", layer.patch.name, problem)
    log.info("aiter_patches: reverted '%s'", name)
    for other in dict.fromkeys(casualties):
        if _states[other].state == APPLIED:
            _revert_one(other)
            _states[other].state = SKIPPED
            _states[other].reason = f"taken off while reverting '{name}': its wrapper could not be rebuilt"


def live_bindings(name: str) -> dict[str, str]:
    """Each location the registry bound for patch ``name``: what it holds now.

    ``ours`` (the chain head the registry installed), ``original`` (AITER's
    object), ``foreign`` (someone rebound it after us), ``missing``.
    """
    patches()
    out: dict[str, str] = {}
    with _lock:
        for chain in _chains.values():
            if not any(l.patch.name == name for l in chain.layers):
                continue
            for mod_name, attr in sorted(chain.locations):
                d = import_hooks.module_dict(sys.modules.get(mod_name))
                head, _, rest = attr.partition(".")
                held = d.get(head, _MISSING) if d is not None else _MISSING
                if rest and held is not _MISSING:  # a "Class.method" target: the class is in the module's dict
                    held = _get_dotted(held, rest)
                out[f"{mod_name}.{attr}"] = ("ours" if held is chain.current else "original" if held is chain.original
                                             else "missing" if held is _MISSING else "foreign")
    return out


# ---------------------------------------------------------------- reporting

def _aiter_info() -> dict[str, Any]:
    mod = sys.modules.get("aiter")
    info: dict[str, Any] = {"imported": mod is not None, "version": None, "location": None}
    if mod is not None:
        info["version"] = getattr(mod, "__version__", None)
        info["location"] = os.path.dirname(getattr(mod, "__file__", "") or "") or None
        info["stand_in"] = bool(getattr(mod, "IS_AITER_PATCHES_STAND_IN", False))
    if info["version"] is None:
        try:
            info["version"] = importlib.metadata.version("amd-aiter")
        except (importlib.metadata.PackageNotFoundError, ValueError):
            pass
    return info


def _record(name: str) -> dict[str, Any]:
    p, st = _patches[name], _states[name]
    return {
        "name": name,
        "summary": p.summary,
        "state": st.state,
        "reason": st.reason,
        "kernel_module": p.kernel_module,
        "order": p.order,
        "targets": [dict(t) for t in st.targets]
        or [{"location": t.location, "signature": None, "pin": None, "aliases": []} for t in p.targets],
        "pins": {t.location: [pin.label for pin in t.pins] for t in p.targets},
        "foreign_layers": foreign_layers.records(name) if st.state == APPLIED else [],
    }


def visit_chains(name: str, visit: Callable[[Any], list]) -> list:
    """``visit(chain)`` for each binding chain that holds a layer of patch ``name``, concatenated; run
    under the registry lock, the one place another module may walk the chains (foreign_layers reads
    the bindings over and under our layers there)."""
    out: list = []
    with _lock:
        for chain in [c for c in _chains.values() if any(layer.patch.name == name for layer in c.layers)]:
            out.extend(visit(chain))
    return out


def status() -> dict[str, Any]:
    """Machine-readable state of every registered patch, and which AITER is loaded."""
    all_patches = patches()
    with _lock:
        return {
            "aiter": _aiter_info(),
            "strict": runtime.strict(),
            "patches": [_record(p.name) for p in all_patches],
        }


def state(name: str) -> str:
    """One patch's state (applied, skipped, pending, disabled, inactive): cheap enough for a call path."""
    patches()
    return _states[name].state


def stats() -> dict[str, dict[str, Any]]:
    """Per patch: fast-path hits, fallbacks by reason, fast-path errors. Host counters only."""
    patches()
    with _lock:
        out = {name: c.snapshot() for name, c in _counters.items()}
        for name, snap in out.items():  # the key appears only when a foreign layer is seen
            if _states[name].state == APPLIED and (layers := foreign_layers.records(name)):
                snap["foreign_layers"] = [layer["text"] for layer in layers]
        return out


def reset_stats() -> None:
    with _lock:
        for c in _counters.values():
            c.reset()


def counters(name: str) -> PatchCounters:
    patches()
    return _counters[name]


def unwrap_foreign(module: str, attr: str, is_layer: Callable[[Any], bool], *, owner: str | None = None) -> list[str]:
    """Take foreign wrappers that sit directly over our chain off its bindings, by identity only.

    A binding is restored to our outermost wrapper only when it holds a Python
    function ``is_layer`` accepts whose ``__wrapped__`` is exactly that wrapper.
    Returns the locations restored. With ``owner`` (an applied patch), reverting
    that patch puts each foreign wrapper back where it was taken off, if that
    location still holds what was put there (or AITER's object, its chain reverted).
    """
    with _lock:
        chain = _chains.get((module, attr))
        if chain is None or chain.current is None:
            return []
        restored = []
        for mod_name, mod in list(sys.modules.items()):
            d = import_hooks.module_dict(mod)
            if d is None:
                continue
            try:
                names = [attr] if mod_name == module else list(d)
            except RuntimeError:  # changed size under a concurrent import
                continue
            for k in names:
                v = d.get(k)
                if type(v) is not types.FunctionType or v is chain.current or not is_layer(v):
                    continue
                if getattr(v, "__wrapped__", None) is chain.current:
                    d[k] = chain.current
                    chain.locations.add((mod_name, k))
                    restored.append(f"{mod_name}.{k}")
                    if owner is not None:
                        _unwrapped.setdefault(owner, []).append((mod_name, k, v, chain.current, chain.original))
        return sorted(restored)


def _rewrap_foreign(owner: str) -> None:
    """Revert of ``owner``: the foreign wrappers it took off go back where they were, if nothing else moved in."""
    for mod_name, k, foreign, put, original in reversed(_unwrapped.pop(owner, [])):
        d = import_hooks.module_dict(sys.modules.get(mod_name))
        if d is None:
            continue
        held = d.get(k, _MISSING)
        if held is put or held is original:
            d[k] = foreign
        else:
            log.warning("aiter_patches: reverting '%s': %s.%s changed since its foreign wrapper was taken off; "
                        "left as it is", owner, mod_name, k)


# ---------------------------------------------------------------- fork

_FORK_WAIT_S = 1.0  # how long fork() waits for another thread to leave the registry
_fork = threading.local()


def _before_fork() -> None:
    """Hold the lock across fork() so the child inherits a consistent registry; never block fork() for long."""
    _fork.held = _lock.acquire(timeout=_FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_fork, "held", False):
        _fork.held = False
        _lock.release()


def _after_fork_in_child() -> None:
    """Fresh locks: one held by a thread of the parent would be held forever here (that thread is gone).

    The package's only fork handler: it renews every lock first (the
    registry's, the import hooks', each patch's counters', the foreign-layer
    memo's, the stats log's), and only then restarts what runs code that takes
    them (the import waiters, the stats thread, the child's summary). Handlers
    registered separately would run in import order, and a waiter restarted
    before the registry's lock was renewed would block on the old one forever.
    """
    global _lock
    held, _fork.held = getattr(_fork, "held", False), False
    _lock = threading.RLock()
    import_hooks.renew_lock_after_fork()
    foreign_layers.renew_lock_after_fork()
    for c in list(_counters.values()):
        c.after_fork_in_child()
    # renews its lock and restarts its thread if the parent had one; the inherited counts are its baseline
    stats_log.after_fork_in_child({name: c.snapshot() for name, c in _counters.items()})
    if not held:
        log.warning("aiter_patches: process %d was forked while another thread had been inside the patch registry "
                    "for over %.0f s; this child's patch states may be incomplete", os.getpid(), _FORK_WAIT_S)
    try:
        import_hooks.restart_waiters_after_fork()
    except Exception:  # e.g. no thread can be started: the patch stays pending
        log.warning("aiter_patches: could not restart the import waiters in process %d", os.getpid(), exc_info=True)
    if process_report.summary_after_fork:
        process_report.log_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
