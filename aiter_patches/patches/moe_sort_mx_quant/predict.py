"""The stage-1 quant prediction of ``moe_sort_mx_quant``: from ``fused_moe``'s arguments, will AITER's stage 1
quantize the activations per 1x32, and to what (MXFP4 or MXFP8)?

It follows ``_fused_moe_impl``'s stage-1 dtype rule and asks AITER's own ``get_2stage_cfgs`` as that function
does (docs/design.md, "Predicted outcome per server call pattern"). A wrong prediction costs time, never bits.
"""

from __future__ import annotations

import os

import torch

from ... import env_flags
from ..moe import call as moe_call
from ..moe.call import enum_value

_PER_1X32 = 3  # QuantType.per_1x32
_SWIGLU, _SITUV2 = 2, 3  # ActivationType

# AITER reads these once, at the import of aiter.fused_moe (fused_moe.py:76-77 at e4048607a5), and
# keeps them as module globals; they are read from there when present, else as AITER would have.
_BYPASS_QUANT_AT_IMPORT = os.environ.get("AITER_MOE_A8W4_BYPASS_QUANT", "0") == "1"
_SWIGLU_BF16_BOUND_AT_IMPORT = env_flags.integer("GPTOSS_SWIGLU_MXFP4_BF16_BOUND", 256)
_PER_128X128, _PER_1X128 = 5, 4


def predict_stage1_quant(bound: dict):
    """The MX dtype AITER's ``fused_moe_2stages`` will quantize the stage-1 activations to, or None.

    Follows AITER's own decisions for ``QuantType.per_1x32`` (fused_moe.py at e4048607a5):
    ``_fused_moe_impl``'s ``q_dtype_a`` rule (≈755-800: MXFP8 weights → fp8; Swiglu with
    separated gates → bf16 below ``GPTOSS_SWIGLU_MXFP4_BF16_BOUND`` tokens, fp4 from it;
    Swiglu/interleaved gates → fp8 on gfx950 from ``AITER_BF16_FP8_MOE_BOUND`` tokens, else
    bf16; SiTUv2 → bf16 unless ``AITER_SITUV2_A8W4``/``A4W4``), then the kernel config the
    same way AITER gets it (``get_2stage_cfgs``, an ``lru_cache`` AITER hits again right
    after: nothing on the device is read), then ``fused_moe_2stages``' stage-1 branch
    (≈3050-3110: no quant when the config does not pre-quantize, for bf16 Swiglu/SiTUv2/
    interleaved stage 1, and for preshuffled fp4 weights with ``ksplit > 1``; the fp8 quant
    skipped under ``AITER_MOE_A8W4_BYPASS_QUANT``). Activations that arrive quantized
    (an fp4x2/fp8 ``hidden_states``) are not quantized by stage 1's helper: None.
    A given ``a1_scale`` with bf16 activations does not stop AITER from quantizing.
    Paths where AITER never asks ``get_2stage_cfgs`` for these arguments are None before
    asking it (it is not free: a miss reads the tuned CSVs, logs, and under
    ``AITER_ONLINE_TUNE=1`` runs a tuning job): the shared-expert arguments (``fused_moe``
    hands the call to ``aiter.fhmoe``), and interleaved gates with FlyDSL available (its
    grouped a8w4 kernel may take the call before any sort).
    """
    g = bound.get
    if (g("shared_w1") is not None or g("shared_w2") is not None or g("shared_w1_scale") is not None
            or g("shared_w2_scale") is not None or g("shared_expert_id", -1) != -1):
        return None  # fused_moe diverts to aiter.fhmoe._fhmoe
    qt = enum_value(g("quant_type", 0))
    if qt == _PER_128X128:
        qt = _PER_1X128
    if qt != _PER_1X32:
        return None
    hidden, w1, w2, topk_ids = g("hidden_states"), g("w1"), g("w2"), g("topk_ids")
    if hidden is None or w1 is None or w2 is None or topk_ids is None:
        return None
    hidden_dtype = hidden.dtype
    out_dtype = g("dtype") or hidden_dtype
    if hidden_dtype not in _HALF or out_dtype not in _HALF:
        return None
    fm = moe_call.aiter_module("aiter.fused_moe")
    dtypes = moe_call.aiter_module().dtypes
    fp4, fp8, w1_dtype = dtypes.fp4x2, dtypes.fp8, w1.dtype
    q_dtype_a = _stage1_dtype(fm, dtypes, bound, w1_dtype, topk_ids.shape[0])
    if q_dtype_a != fp4 and q_dtype_a != fp8:
        return None
    metadata = _kernel_config(fm, bound, q_dtype_a, out_dtype)
    if metadata is None or getattr(metadata, "run_1stage", False) or not getattr(metadata, "prequant", True):
        return None
    if w1_dtype == fp4 and q_dtype_a == fp4 and metadata.ksplit > 1 and (_is_shuffled(w1) or _is_shuffled(w2)):
        return None  # CK-Tile split-K stage 1 on the bf16 activations
    if q_dtype_a == fp8:
        return None if getattr(fm, "_MOE_A8W4_BYPASS_QUANT", _BYPASS_QUANT_AT_IMPORT) else fp8
    return fp4


_HALF = (torch.bfloat16, torch.float16)


def _is_shuffled(w) -> bool:
    return bool(getattr(w, "is_shuffled", False))


def _stage1_dtype(fm, dtypes, bound, w1_dtype, tokens):
    """``_fused_moe_impl``'s ``q_dtype_a`` for ``per_1x32`` (None: a path this patch does not model)."""
    if w1_dtype == dtypes.fp8:
        return dtypes.fp8
    if w1_dtype != dtypes.fp4x2:
        return None  # int4 weights (a16wi4: bf16 stage 1), or a dtype AITER's rule does not name
    gfx = fm.get_gfx() if hasattr(fm, "get_gfx") else None
    if gfx == "gfx1250":
        return None  # its own grouped kernels
    act = enum_value(bound.get("activation", 0))
    gate = bound.get("gate_mode", "separated")
    interleaved = getattr(gate, "value", gate) == "interleave"
    if act == _SITUV2:
        if interleaved and _flydsl(fm):
            return None  # AITER may take its grouped a8w4 kernel before any sort
        if os.environ.get("AITER_SITUV2_A8W4", "0") == "1":
            return dtypes.fp8
        if os.environ.get("AITER_SITUV2_A4W4", "0") == "1":
            return dtypes.fp4x2
        return dtypes.bf16
    if act == _SWIGLU and not interleaved:
        bound_m = getattr(fm, "_SWIGLU_MXFP4_BF16_BOUND", _SWIGLU_BF16_BOUND_AT_IMPORT)
        return dtypes.bf16 if tokens < bound_m else dtypes.fp4x2
    if act == _SWIGLU or interleaved:
        if interleaved and _flydsl(fm):
            return None  # AITER may take its grouped a8w4 kernel before any sort
        fp8_bound = env_flags.integer("AITER_BF16_FP8_MOE_BOUND", 256)
        return dtypes.bf16 if gfx != "gfx950" or tokens < fp8_bound else dtypes.fp8
    return dtypes.fp4x2


def _flydsl(fm) -> bool:
    try:
        return bool(fm.is_flydsl_available())
    except Exception:  # noqa: BLE001 - an unknown answer is "maybe": predict nothing
        return True


def _kernel_config(fm, bound, q_dtype_a, out_dtype):
    """AITER's ``get_2stage_cfgs`` result for this call, asked exactly as ``_fused_moe_impl`` asks
    (same positional/keyword layout, so AITER's own ``lru_cache`` answers its next call).

    Kept per :data:`CONFIGS` key: the plain values it is asked with (ints, strings, shapes, dtypes;
    the enums by value) and the AITER functions and enums it goes through, by identity. AITER keeps
    the answer in that ``lru_cache`` for the same arguments; asking it again costs microseconds a
    call (its key hashes four Python enums and keywords). A call that raised is asked again."""
    try:
        g = bound.get
        w1, w2, topk_ids = bound["w1"], bound["w2"], bound["topk_ids"]
        gate = g("gate_mode")
        act, gate = enum_value(g("activation", 0)), getattr(gate, "value", gate) or "separated"
        doweight, hidden_pad, inter_pad = bool(g("doweight_stage1", False)), g("hidden_pad", 0), g("intermediate_pad", 0)
        s1, s2 = _is_shuffled(w1), _is_shuffled(w2)
        ids_shape, w1_shape, w2_shape = topk_ids.shape, w1.shape, w2.shape
        ask = fm.get_2stage_cfgs
        key = (ask, fm.get_inter_dim, fm.get_padded_M, fm.QuantType, fm.ActivationType, fm.GateMode,
               ids_shape, w1_shape, w2_shape, w1.dtype, out_dtype, q_dtype_a, act, gate, doweight,
               hidden_pad, inter_pad, s1, s2, g("expert_mask") is None, g("bias2") is None)
        if type(gate) is not str or type(hidden_pad) is not int or type(inter_pad) is not int:
            key = None  # asked as given, every call (a tensor's value is not in a key)
        else:
            got = CONFIGS.get(key)
            if got is not None:
                return got
        M, topk = ids_shape
        E, model_dim, inter_dim = fm.get_inter_dim(w1_shape, w2_shape)
        config = ask(
            fm.get_padded_M(M), model_dim, inter_dim, E, topk, out_dtype, q_dtype_a, w1.dtype,
            _member(fm.QuantType, _PER_1X32), inter_dim != w1_shape[1],
            _member(fm.ActivationType, act), doweight, hidden_pad, inter_pad, s1 or s2,
            _member(fm.GateMode, gate),
            is_ep=g("expert_mask") is not None,
            has_stage2_bias=g("bias2") is not None,
            opus_weights_shuffled=s1 and s2,
            config_file=None,
        )
    except Exception:  # noqa: BLE001 - AITER's own call will raise the same; predict nothing
        return None
    if key is not None and config is not None and len(CONFIGS) < MAXCONFIGS and not torch.compiler.is_compiling():
        CONFIGS[key] = config
    return config


MAXCONFIGS = 1024
CONFIGS: dict[tuple, object] = {}  # _kernel_config's key -> AITER's answer (never a tensor: AITER's config object)


_MEMBERS: dict[tuple, object] = {}  # (enum class, value) -> member: an Enum lookup by value costs ~1 µs


def _member(enum_cls, value):
    """``enum_cls(value)``, remembered (a value the enum refuses raises, every time, as before)."""
    key = (enum_cls, type(value), value)
    member = _MEMBERS.get(key)
    if member is None:
        member = enum_cls(value)
        if len(_MEMBERS) < 256:
            _MEMBERS[key] = member
    return member
