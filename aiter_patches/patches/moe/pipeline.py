"""One MoE pipeline: one wrapper per AITER target, whatever MoE features are applied.

The three MoE patches (``moe_addend_fold``, ``sort_extension``, ``moe_sort_mx_quant``) work on the same AITER
functions and hand each other data within one ``fused_moe`` call. Each stays a registry patch of its own (name,
status row, enable/disable switch, all-or-nothing gate on its targets' pins, revert, counters), but they share one
wrapper per target: it binds the arguments once and runs the applied features' steps in the order of the table
below, passing one plan (:class:`moe_call.MoeCall`, per ``fused_moe`` call) and one step object
(:class:`FusedMoeStep` / :class:`SortStep`, per wrapped call). Each feature declares the fields it reads and writes
(``call.*`` the plan, ``fused_moe.*`` / ``sort.*`` the step; every feature may read the bound arguments:
``arguments`` and ``problems``, ``bind()``, ``arguments_key()``, ``layout()``, ``picker()`` and ``pick()`` on the
sort's step, ``meta_key()`` on ``fused_moe``'s, and run AITER's function on them, ``call_aiter()``); the tests run
every step through a check of those declarations (:func:`run_steps_through`), where an undeclared access raises.

=================  ====  ==================  ===================  ==========================================  ==========================================
target             step  feature             does                 reads                                       writes
=================  ====  ==================  ===================  ==========================================  ==========================================
fused_moe          1     moe_addend_fold     take_addend          fused_moe.keywords                          call.addend, call.addend_state
fused_moe          2     moe_sort_mx_quant   predict_quant        call.quant_dtype                            call.quant_dtype
fused_moe          --    AITER's fused_moe   (a call it opens lends its sort outputs: call.scratch, sort_scratch.py)
fused_moe          3     moe_sort_mx_quant   count_unreached      call.sort_reached                           (counters)
fused_moe          4     moe_addend_fold     add_or_count         call.addend, call.addend_state,             fused_moe.output (adds the addend in place)
                                                                  call.moe_buf, fused_moe.output
_moe_sorting_impl  0     (pipeline)          sort reached                                                     call.sort_reached, call.own_sort
_moe_sorting_impl  1     sort_extension      find_extensions                                                  sort.extensions, sort.sort_call
_moe_sorting_impl  2     moe_addend_fold     decide_fold          call.addend, call.addend_state,             call.addend_state, sort.folding,
                                                                  sort.extensions                             sort.addend_offer
_moe_sorting_impl  3     sort_extension      offer_sort           sort.extensions, sort.sort_call,            sort.outputs, call.stage1_quant
                                                                  sort.outputs
_moe_sorting_impl  4     moe_sort_mx_quant   one_launch_sort      call.hidden_states, call.quant_dtype,       sort.outputs, sort.addend_written,
                                                                  call.stage1_quant, sort.addend_offer,       call.stage1_quant
                                                                  sort.outputs
_moe_sorting_impl  --    AITER's sort        (if no outputs yet)
_moe_sorting_impl  5     sort_extension      after_sort           sort.extensions, sort.sort_call,
                                                                  sort.outputs
_moe_sorting_impl  6     moe_addend_fold     start_from_addend    call.addend, sort.folding, sort.outputs,    call.moe_buf, call.addend_state
                                                                  sort.addend_written
mx quant helpers   1     (pipeline)          hand_back            call.stage1_quant                           the quant's ``consumed``
=================  ====  ==================  ===================  ==========================================  ==========================================

How they combine (the only interactions; a feature that is not applied skips its steps):

- The sort's outputs come from the first producer: an extension (innermost scope first, step 3), else the one-
  launch sort (step 4), else AITER. Whoever produced them, extensions' ``after_sort`` runs next (step 5), then the
  addend fold (6).
- The addend goes into ``moe_buf`` in the one-launch sort's own launch only when no active extension has
  ``after_sort`` work (it may produce the addend); otherwise, and after an extension's or AITER's sort, it is
  copied in at step 6.
- The stage-1 MX quant is made at most once per call, by an extension's sixth item or by the one-launch sort (when
  predicted, and none was made), and handed back to the one helper call it matches, counted as a hit (or a
  fallback) of its producer.
- None of the features changes bits: with any subset applied the output is AITER's, with ``moe_buf`` started from
  the addend where the fold says so (tests/patches/test_moe_pipeline.py runs all eight subsets).

How the registry's per-patch layers map onto one wrapper: each feature's target factory builds the pipeline wrapper
for the features applied at and below its own layer (the registry composes layers innermost first); the wrapper
calls AITER's function directly, while ``__wrapped__`` still names the layer below, so status, revert by identity
and every check that walks the chain see one layer per patch. Reverting a feature rebuilds or reuses wrappers as the
registry does for any chain; a stale wrapper (a reference revert cannot rebind) notices that a feature below it was
disarmed (its code swapped for the registry's pass-through) and skips that feature's steps, as the chained wrappers
did.
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref
from typing import Any, Callable

from ... import call_key
from .. import pins
from . import call as moe_call
from . import sort_scratch
from .call import MoeCall, joined_or_new, like

FUSED_MOE = "fused_moe"
SORT = "_moe_sorting_impl"
MXFP4_QUANT = "fused_dynamic_mxfp4_quant_moe_sort"
MXFP8_QUANT = "fused_dynamic_mxfp8_quant_moe_sort"
MODULE = "aiter.fused_moe"
_QUANT_KIND = {MXFP4_QUANT: "fp4", MXFP8_QUANT: "fp8"}
_PINS = {FUSED_MOE: pins.FUSED_MOE, SORT: pins.MOE_SORTING_IMPL,
         MXFP4_QUANT: pins.MXFP4_QUANT_MOE_SORT, MXFP8_QUANT: pins.MXFP8_QUANT_MOE_SORT}

# The steps of each wrapped target, in order: (feature name, method), "AITER" where AITER's function runs.
AITER = "AITER"
STEPS: dict[str, tuple] = {
    FUSED_MOE: (
        ("moe_addend_fold", "take_addend"),
        ("moe_sort_mx_quant", "predict_quant"),
        AITER,
        ("moe_sort_mx_quant", "count_unreached"),
        ("moe_addend_fold", "add_or_count"),
    ),
    SORT: (
        ("sort_extension", "find_extensions"),
        ("moe_addend_fold", "decide_fold"),
        ("sort_extension", "offer_sort"),
        ("moe_sort_mx_quant", "one_launch_sort"),
        AITER,
        ("sort_extension", "after_sort"),
        ("moe_addend_fold", "start_from_addend"),
    ),
}
ALWAYS_READABLE = frozenset({"arguments", "problems", "bind", "arguments_key", "meta_key", "layout", "picker", "pick",
                             "call_aiter"})


class Feature:
    """A MoE feature: one registry patch whose targets are served by the pipeline's wrappers.

    ``reads``/``writes``: ``"call.<field>"`` (the plan), ``"fused_moe.<field>"`` /
    ``"sort.<field>"`` (the step). ``keywords``: extra ``fused_moe`` keywords it takes;
    a feature with keywords engages on ``fused_moe`` only when one is given (not None),
    the others on every call. Its steps are the methods :data:`STEPS` names,
    ``method(site, call, step)``; ``call`` is None for a sort outside ``fused_moe``.
    """

    name: str = ""
    reads: frozenset[str] = frozenset()
    writes: frozenset[str] = frozenset()
    keywords: tuple[str, ...] = ()

    def refuse(self, site, problem: str) -> None:
        """``fused_moe``'s arguments do not fit the pin: AITER gets the call, counted (or raise)."""
        site.counters.fallback(f"fused_moe: {problem}")

    def forget(self) -> None:
        """Drop what the feature decided once and kept (its verdicts): called whenever a wrapper of
        it is built, so a patch applied again (AITER changed in between, say) decides afresh."""


FEATURES: dict[str, Feature] = {}


def feature(f: Feature) -> Feature:
    """Register a feature (its module's import does)."""
    FEATURES[f.name] = f
    return f


class FusedMoeStep:
    """One ``fused_moe`` call: its bound arguments, the extra keywords taken off, AITER's output."""

    __slots__ = ("arguments", "problems", "keywords", "output", "_again", "_binder")
    FIELDS = frozenset({"keywords", "output"})
    PREFIX = "fused_moe"

    def __init__(self, arguments: dict, keywords: dict, again=None, binder=None):
        self.arguments, self.problems, self.keywords, self.output, self._again = arguments, (), keywords, None, again
        self._binder = binder

    def call_aiter(self):  # AITER's fused_moe on this call's arguments, less the extra keywords (the self-check)
        original, args, kwargs = self._again
        return original(*args, **kwargs)

    def meta_key(self) -> tuple:
        """The call's arguments as given, less the extra keywords, keyed by :func:`call_key.meta_key` (each
        tensor's type, shape, dtype and device; raises :class:`call_key.Unkeyable`), with the binder that
        bound them: what ``arguments`` holds of them is a function of this key."""
        _, args, kwargs = self._again
        return call_key.meta_key(args, kwargs), self._binder


class SortStep:
    """One ``_moe_sorting_impl`` call. Its arguments are bound at the first step that reads them
    (binding costs microseconds; a call no step looks at is not bound). The step fields' defaults
    are class attributes: a call sets only what its steps write."""

    FIELDS = frozenset({"extensions", "sort_call", "outputs", "folding", "addend_offer", "addend_written"})
    PREFIX = "sort"
    extensions: tuple = ()
    sort_call = None
    outputs = None
    folding = False
    addend_offer = None  # the addend, when the one-launch sort may write it as moe_buf's fill
    addend_written = False
    _bound = None

    def __init__(self, binder, args: tuple, kwargs: dict, aiter=None):
        self._binder, self._args, self._kwargs, self._aiter = binder, args, kwargs, aiter

    def call_aiter(self):  # AITER's sort on this call's own arguments (the self-check's other side)
        return self._aiter(*self._args, **self._kwargs)

    def bind(self) -> tuple[dict, list]:
        """``(arguments, problems)``: the call's arguments by name, and what the pin does not explain."""
        if self._bound is None:
            self._bound = self._binder.bind(self._args, self._kwargs)
        return self._bound

    def arguments_key(self) -> tuple[tuple, tuple]:
        """``(key, tensors)``: the call's arguments as given, split by :func:`call_key.split_key` (the
        binder that reads them in the key; raises :class:`call_key.Unkeyable`): what ``bind()`` returns
        is a function of the key and of the tensors' metadata that a guard over ``tensors`` checks."""
        key, tensors = call_key.split_key(self._args, self._kwargs)
        return (key, self._binder), tensors

    def layout(self) -> tuple:
        """How the arguments are given (the binder, the positional count, the keyword names): calls
        of one layout bind alike, with the same problems, and share their pickers."""
        return self._binder, len(self._args), tuple(self._kwargs)

    def picker(self, names: tuple) -> Callable[["SortStep"], tuple]:
        """For calls whose arguments are given like this one's (same count, same keywords: the
        :meth:`arguments_key` says so), ``f(step) -> the values of names`` as ``bind()`` gives
        them (None where not given), without binding."""
        positional = self._binder.positional
        where = []
        for name in names:
            i = positional.index(name) if name in positional else len(self._args)
            where.append(i if i < len(self._args) else name)
        if all(type(i) is int for i in where) and len(where) > 1:
            get = operator.itemgetter(*where)
            return lambda step: get(step._args)
        return _straight_picker(tuple(where))

    def pick(self, picker) -> tuple:
        """``picker(self)``: see :meth:`picker`."""
        return picker(self)


_PICKERS: dict[tuple, Callable] = {}


def _straight_picker(where: tuple) -> Callable:
    """``f(step)``: for each entry, ``step._args[i]`` (an int) or ``step._kwargs.get(name)``, as one
    generated expression (a generator over the entries costs a frame per value: issue 15)."""
    if not where:
        return lambda step: ()
    got = _PICKERS.get(where)
    if got is None:
        ns: dict[str, Any] = {f"N{j}": name for j, name in enumerate(where)}  # names as constants, never as code
        items = [f"a[{i}]" if type(i) is int else f"k.get(N{j})" for j, i in enumerate(where)]
        exec(f"def pick(step):\n    a, k = step._args, step._kwargs\n    return ({', '.join(items)},)\n", ns)  # noqa: S102 - positions and N<j> only
        got = ns["pick"]
        if len(_PICKERS) < 256:
            _PICKERS[where] = got
    return got


# ---------------------------------------------------------------- how the steps run (a seam for the tests)

_STEP_MAKER: list = [None]  # None: each step called directly; else make(feature, method, site) -> run(call, step)
_LIVE_STAGES: "weakref.WeakSet[_Stages]" = weakref.WeakSet()


def run_steps_through(make: Callable[[Feature, str, Any], Callable[[Any, Any], None]] | None):
    """Every feature step, in every wrapper built and to be built, runs as ``make(feature, method, site)``
    (``None``: the step itself, called directly); returns the previous ``make``. The tests check the
    features' declared fields this way (``tests/helpers/moe_declared.py``). A wrapper reads no switch
    per call: its stages are rebuilt here."""
    before, _STEP_MAKER[0] = _STEP_MAKER[0], make
    for stages in list(_LIVE_STAGES):
        stages.steps = stages.resolve(make)
    return before


class _Stages:
    """The steps of one target for one set of engaged features, resolved to callables ``(call, step)``
    before AITER's function and after it: ``steps``, what a wrapper runs."""

    __slots__ = ("spec", "steps", "refusals", "sites", "__weakref__")

    def __init__(self, kind: str, layers: tuple):
        sites = {name: site for name, site in layers}
        self.sites = tuple(sites.values())
        spec: tuple[list, list] = ([], [])
        half = 0
        for step in STEPS.get(kind, ()):
            if step == AITER:
                half = 1
                continue
            name, method = step
            if name in sites:
                spec[half].append((FEATURES[name], method, sites[name]))
        self.spec = (tuple(spec[0]), tuple(spec[1]))
        self.steps = self.resolve(_STEP_MAKER[0])
        _LIVE_STAGES.add(self)
        self.refusals = tuple((FEATURES[n].refuse, s) for n, s in sites.items())

    def resolve(self, make) -> tuple[tuple, tuple]:
        if make is None:
            return tuple(tuple(functools.partial(getattr(f, method), site) for f, method, site in half)
                         for half in self.spec)
        return tuple(tuple(make(f, method, site) for f, method, site in half) for half in self.spec)


# ---------------------------------------------------------------- the wrappers

class _Built:
    """What a pipeline wrapper serves: AITER's function, the features' layers (innermost first), their wrappers,
    and the code it was built with (a reverted wrapper's code is swapped for the registry's pass-through)."""

    __slots__ = ("kind", "original", "layers", "wrappers", "code")

    def __init__(self, kind, original, layers, wrappers, code=None):
        self.kind, self.original, self.layers, self.wrappers, self.code = kind, original, layers, wrappers, code


_MARK = "__aiter_patches_moe_pipeline__"


def wrapper(kind: str, name: str) -> Callable:
    """The registry's wrapper factory for feature ``name`` on target ``kind``."""

    def factory(inner, site):
        FEATURES[name].forget()
        below = getattr(inner, _MARK, None)
        # trusted only on our own wrapper itself: functools.wraps copies __dict__, so a foreign wrapper
        # over ours carries the mark too, and building past it would drop that wrapper from the chain
        if isinstance(below, _Built) and below.kind == kind and below.wrappers[-1] is inner:
            original, layers, guards = below.original, below.layers + ((name, site),), below.wrappers
        else:
            original, layers, guards = inner, ((name, site),), ()
        fn = _BUILDERS[kind](kind, original, layers, guards)
        setattr(fn, _MARK, _Built(kind, original, layers, guards + (fn,), fn.__code__))
        return like(fn, original)

    return factory


def takes_keyword(fn: Callable, keyword: str) -> bool:
    """Whether a call of ``fn`` (a binding, read now) reaches an armed pipeline wrapper with a feature that
    takes the extra keyword ``keyword``: ``fn`` itself, or the one under this package's own layers over it
    (which pass keywords they do not know on). A foreign wrapper, or a reverted one, says no."""
    for _ in range(8):
        built = getattr(fn, _MARK, None)
        if isinstance(built, _Built) and built.wrappers[-1] is fn and fn.__code__ is built.code:
            return any(keyword in FEATURES[n].keywords for n, _ in built.layers)
        where = getattr(fn, "__globals__", None)
        if not isinstance(where, dict) or not str(where.get("__name__", "")).startswith("aiter_patches."):
            return False
        fn = getattr(fn, "__wrapped__", None)
    return False


def _armed(kind: str, layers: tuple, guards: tuple, code, cache: dict) -> Callable[[], Any]:
    """A function giving the stages of the features still armed (all, unless a stale wrapper is called)."""
    full = _resolve(kind, layers, cache)

    def armed():
        for g in guards:
            if g.__code__ is not code:
                live = tuple(layer for layer, w in zip(layers, guards) if w.__code__ is code) + layers[len(guards):]
                return _resolve(kind, live, cache)
        return full

    return armed


def _resolve(kind: str, layers: tuple, cache: dict):
    key = tuple(n for n, _ in layers)
    got = cache.get(key)
    if got is None:
        got = cache[key] = _FusedMoeStages(layers) if kind == FUSED_MOE else _Stages(kind, layers)
    return got


class _FusedMoeStages:
    """``fused_moe``'s stages per set of extra keywords given: the features with keywords engage only then."""

    __slots__ = ("keywords", "by_given")

    def __init__(self, layers: tuple):
        self.keywords = tuple(k for n, _ in layers for k in FEATURES[n].keywords)
        always = tuple((n, s) for n, s in layers if not FEATURES[n].keywords)
        self.by_given = {}
        for mask in range(1 << len(self.keywords)):
            given = tuple(k for i, k in enumerate(self.keywords) if mask >> i & 1)
            engaged = tuple((n, s) for n, s in layers if n in dict(always) or set(FEATURES[n].keywords) & set(given))
            self.by_given[given] = _Stages(FUSED_MOE, engaged) if engaged else None


def _build_fused_moe(kind, original, layers, guards):
    binder = layers[-1][1].binder
    cache: dict = {}

    def fused_moe(*args, **kwargs):
        stages = armed() if guards else full
        given = {}
        for k in stages.keywords:
            v = kwargs.pop(k, None)
            if v is not None:
                given[k] = v
        engaged = stages.by_given[tuple(given)]
        if engaged is None:
            return original(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        if problems:
            for refuse, site in engaged.refusals:
                refuse(site, problems[0])
            return original(*args, **kwargs)
        call, new = joined_or_new(bound)
        step = FusedMoeStep(bound, given, (original, args, kwargs), binder)
        before, after = engaged.steps
        for run in before:
            run(call, step)
        if new:  # moe_call.scope's set and reset, inline: a generator context manager costs ~1 µs a call
            call.scratch = []  # AITER's fused_moe returns moe_buf alone: the sort's other outputs may be reused
            token = set_call(call)
            try:
                step.output = original(*args, **kwargs)
            finally:
                reset_call(token)
                release(call)  # gives its sets back and closes it: a sort under a scope of it later allocates
        else:
            step.output = original(*args, **kwargs)
        for run in after:
            run(call, step)
        return step.output

    armed = _armed(kind, layers, guards, fused_moe.__code__, cache)
    full = armed()
    set_call, reset_call = moe_call._CALL.set, moe_call._CALL.reset
    release = sort_scratch.release
    return fused_moe


def _build_sort(kind, original, layers, guards):
    binder = layers[-1][1].binder
    cache: dict = {}

    def _moe_sorting_impl(*args, **kwargs):
        stages = armed() if guards else full
        call = current()
        if call is not None:
            if call.scratch is not None:  # a call the fused_moe wrapper opened: may this sort lend its outputs?
                call.own_sort = not call.sort_reached and _from_aiters_fused_moe(sys._getframe(1))
            call.sort_reached = True
        step = SortStep(binder, args, kwargs, original)
        before, after = stages.steps
        for run in before:
            run(call, step)
        if step.outputs is None:
            step.outputs = original(*args, **kwargs)
        for run in after:
            run(call, step)
        return step.outputs

    armed = _armed(kind, layers, guards, _moe_sorting_impl.__code__, cache)
    full = armed()
    current = moe_call._CALL.get
    return _moe_sorting_impl


def _from_aiters_fused_moe(caller) -> bool:
    """Whether the sort wrapper's caller is AITER's ``moe_sorting``, itself called by AITER's code in
    ``aiter.fused_moe`` (``_fused_moe_impl``): the pipeline's own sort, not a direct call from a hook or a
    layer inside the call (sort_scratch.py lends the outputs of the own sort only)."""
    mod = sys.modules.get(MODULE)
    if mod is None or caller is None or caller.f_code.co_name != "moe_sorting":
        return False
    where = vars(mod)
    up = caller.f_back
    return caller.f_globals is where and up is not None and up.f_globals is where


def _build_quant_helper(kind, original, layers, guards):
    """Hand back the stage-1 quant made at sort time, for exactly the call it was made for."""
    binder = layers[-1][1].binder
    quant = _QUANT_KIND[kind]
    cache: dict = {}

    def quant_moe_sort(*args, **kwargs):
        call = moe_call.current()
        q = call.stage1_quant if call is not None else None
        if q is None or q.consumed:
            return original(*args, **kwargs)
        bound, problems = binder.bind(args, kwargs)
        reason = problems[0] if problems else moe_call.quant_mismatch(q, bound, quant)
        counters = q.counters or armed().sites[-1].counters
        if reason is None:
            q.consumed = True
            counters.hit()
            return q.data, q.scale
        if reason != moe_call.NOT_STAGE1:
            counters.fallback(f"stage-1 quant not taken from the sort: {reason}")
        return original(*args, **kwargs)

    armed = _armed(kind, layers, guards, quant_moe_sort.__code__, cache)
    return quant_moe_sort


_BUILDERS = {FUSED_MOE: _build_fused_moe, SORT: _build_sort,
             MXFP4_QUANT: _build_quant_helper, MXFP8_QUANT: _build_quant_helper}


def target(kind: str, name: str, why: str):
    """The registry :class:`Target` of feature ``name`` on AITER's ``kind``, served by the pipeline."""
    from ...core.declarations import Target

    return Target(MODULE, kind, _PINS[kind], wrapper(kind, name), why)


def stage1_quant_targets(name: str, producer: str) -> tuple:
    """The two MX quant-sort helpers ``fused_moe_2stages`` looks up in ``aiter.fused_moe``'s globals,
    as targets that hand back a stage-1 quant made by ``producer`` (the sort, or an extension)."""
    return tuple(
        target(kind, name, f"Looked up in aiter.fused_moe's globals by fused_moe_2stages: returns {producer}'s "
                           f"MX{_QUANT_KIND[kind].upper()} stage-1 quant.")
        for kind in (MXFP4_QUANT, MXFP8_QUANT)
    )


__all__ = ["Feature", "FEATURES", "STEPS", "MoeCall", "feature", "run_steps_through", "target",
           "stage1_quant_targets", "takes_keyword", "wrapper"]
