"""The MoE pipeline's declared fields, checked: every feature step reads and writes only what it declares.

Each MoE feature declares the fields of the plan (``call.*``) and of the step (``fused_moe.*`` /
``sort.*``) it reads and writes (``moe_pipeline.Feature.reads`` / ``writes``). Inside
:func:`checking` every step runs on proxies of the two that raise :class:`UndeclaredField` on any
other access. The pipeline runs its steps through :func:`checked_step` then
(``moe_pipeline.run_steps_through``); outside, it calls them directly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from aiter_patches.patches import moe_call, moe_pipeline


class UndeclaredField(AttributeError):
    """A feature read or wrote a field of the plan or step that it does not declare."""


def plan_fields() -> dict[str, frozenset]:
    """Every field a feature may declare, by prefix."""
    return {"call": moe_call.PLAN_FIELDS, moe_pipeline.FusedMoeStep.PREFIX: moe_pipeline.FusedMoeStep.FIELDS,
            moe_pipeline.SortStep.PREFIX: moe_pipeline.SortStep.FIELDS}


class _Checked:
    __slots__ = ("_obj", "_feature", "_prefix")

    def __init__(self, obj, feature, prefix: str):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_feature", feature)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        key = f"{self._prefix}.{name}"
        f = self._feature
        if name not in moe_pipeline.ALWAYS_READABLE and key not in f.reads and key not in f.writes:
            raise UndeclaredField(f"feature '{f.name}' reads {key}, which it does not declare")
        return getattr(self._obj, name)

    def __setattr__(self, name: str, value) -> None:
        key = f"{self._prefix}.{name}"
        if key not in self._feature.writes:
            raise UndeclaredField(f"feature '{self._feature.name}' writes {key}, which it does not declare")
        setattr(self._obj, name, value)


def _tracing() -> bool:
    """Under torch.compile's tracing the checking proxy is not traced (Dynamo cannot follow ``__getattr__``)."""
    import torch

    return torch.compiler.is_compiling()


def checked_step(f, method: str, site) -> Callable[[Any, Any], None]:
    """Feature ``f``'s step ``method`` at ``site``, run on proxies that allow only its declared fields."""
    fn = getattr(f, method)

    def run(call, step):
        if _tracing():
            fn(site, call, step)
        else:
            fn(site, None if call is None else _Checked(call, f, "call"), _Checked(step, f, step.PREFIX))

    return run


@contextlib.contextmanager
def checking(on: bool = True) -> Iterator[None]:
    """Run every feature step against its declarations (``on``), or directly (``on=False``), inside the scope."""
    before = moe_pipeline.run_steps_through(checked_step if on else None)
    try:
        yield
    finally:
        moe_pipeline.run_steps_through(before)
