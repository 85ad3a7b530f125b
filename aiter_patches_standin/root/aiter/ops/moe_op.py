"""Stand-in for ``aiter/ops/moe_op.py`` and ``aiter/ops/activation.py``: the MoE GEMM stage ops
and the gate activations ``fused_moe``'s stage functions call (AITER's names and signatures).

Real AITER launches compiled CK / CK-Tile kernels here. The stand-in runs the
torch leaf kernels, so the stand-in's ``fused_moe`` calls the same ops in the
same order as AITER's for the same arguments, and the real-AITER tests
(``tests/real_aiter``) replace AITER's compiled ops with these same functions.
Weights are used unshuffled (the stand-in does not model AITER's preshuffle);
``is_shuffled`` only steers AITER's branch choice.
"""

import torch

from . import _leaf_kernels as _leaf
from .enum import ActivationType, QuantType

__all__ = [
    "ck_moe_stage1_fwd",
    "ck_moe_stage2_fwd",
    "moe_cktile2stages_gemm1",
    "moe_cktile2stages_gemm2",
    "moe_stage1_g1u1",
    "silu_and_mul",
    "gelu_and_mul",
    "swiglu_and_mul",
    "flydsl_silu_and_mul_interleaved",
    "flydsl_swiglu_and_mul_interleaved",
]


def _act(activation) -> ActivationType:
    return ActivationType(int(getattr(activation, "value", activation)))


def _gemm_rows(a, a_scale, w, w_scale, sorted_ids, sorted_expert_ids, num_valid_ids, out_rows, topk, token_num,
               block_m, sorted_weights=None, pair_rows=False):
    """fp32 ``a @ w[expert]^T`` of every valid sorted slot, written in ``out_rows.dtype`` to
    ``out_rows[token*topk + slot]`` (stage 1 reads row ``token``; stage 2, ``pair_rows``, row
    ``token*topk + slot``). Other rows untouched."""
    num_experts = w.shape[0]
    in_features = w.shape[2] * (2 if _leaf._is_packed(w, w_scale) else 1)
    num_blocks, s, valid, token, slot, expert = _leaf._slot_table(
        sorted_ids, sorted_expert_ids, num_valid_ids, topk, token_num, block_m, num_experts
    )
    x = _leaf._activation_rows(a, a_scale, token * topk + slot if pair_rows else token, s, in_features)
    h = _leaf._block_gemm(x, w, w_scale, expert, num_blocks, block_m, in_features)
    if sorted_weights is not None:
        h = h * sorted_weights.reshape(-1)[s].float().view(-1, 1)
    _leaf._scatter_rows_(out_rows, token * topk + slot, h, valid)


def _swiglu(gate, up, alpha=1.702, limit=7.0):
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def _gated(out, input, fn):
    n = out.shape[-1]
    x = input.reshape(-1, 2 * n).float()
    out.reshape(-1, n).copy_(fn(x[:, :n], x[:, n:]))


def silu_and_mul(out, input, limit=0.0):
    """``out = silu(gate) * up`` over ``input = [gate | up]`` (AITER's ``module_activation``)."""
    _gated(out, input, lambda g, u: torch.nn.functional.silu(g) * u)


def gelu_and_mul(out, input):
    _gated(out, input, lambda g, u: torch.nn.functional.gelu(g) * u)


def swiglu_and_mul(out, input):
    """gpt-oss SwiGLU: ``gate * sigmoid(1.702 gate) * (up + 1)``, clamped at 7."""
    _gated(out, input, _swiglu)


def _interleaved(input, out, fn, lanes=16):
    """Gate/up rows interleaved in ``lanes``-wide blocks (AITER's preshuffled fp4 split-K layout)."""
    n = out.shape[-1]
    x = input.reshape(-1, n // lanes, 2, lanes).float()
    out.reshape(-1, n).copy_(fn(x[:, :, 0, :].reshape(-1, n), x[:, :, 1, :].reshape(-1, n)))


def flydsl_silu_and_mul_interleaved(input, out, sorted_token_ids, num_valid_ids, token_num, topk, quant_mode="none",
                                    gui_layout=True):
    """AITER ``aiter.ops.flydsl.moe_kernels.flydsl_silu_and_mul_interleaved`` (a FlyDSL kernel there)."""
    _interleaved(input, out, lambda g, u: torch.nn.functional.silu(g) * u)


def flydsl_swiglu_and_mul_interleaved(input, out):
    _interleaved(input, out, _swiglu)


_ACT = {ActivationType.Silu: silu_and_mul, ActivationType.Gelu: gelu_and_mul, ActivationType.Swiglu: swiglu_and_mul}


def _stage1_activated(hidden_states, w1, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk, block_m,
                      a1_scale, w1_scale, sorted_weights, activation):
    token_num = out.shape[0]
    act = _act(activation)
    if act in (ActivationType.Silu, ActivationType.Gelu):
        _leaf.moe_stage1(hidden_states, w1, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                         token_num=token_num, block_m=block_m, a1_scale=a1_scale, w1_scale=w1_scale,
                         sorted_weights=sorted_weights, activation=act.name.lower(), is_g1u1=True)
        return
    if act not in _ACT:
        raise NotImplementedError(f"stand-in stage 1 has no activation {act!r}")
    raw = torch.zeros(token_num * topk, w1.shape[1], dtype=torch.float32, device=out.device)
    _gemm_rows(hidden_states, a1_scale, w1, w1_scale, sorted_token_ids, sorted_expert_ids, num_valid_ids, raw,
               topk, token_num, block_m, sorted_weights)
    _ACT[act](out.view(token_num * topk, -1), raw)


def ck_moe_stage1_fwd(hidden_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                      kernelName="", w1_scale=None, a1_scale=None, block_m=32, sorted_weights=None,
                      quant_type=QuantType.No, activation=ActivationType.Silu, splitk=1,
                      use_non_temporal_load=False, dst_type=None):
    """AITER ``ck_moe_stage1_fwd``: the CK 2-stage gate/up GEMM with the activation fused."""
    _stage1_activated(hidden_states, w1, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk, block_m,
                      a1_scale, w1_scale, sorted_weights, activation)
    return out


def moe_stage1_g1u1(input, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, inter_dim, kernelName,
                    block_m, ksplit=0, activation=ActivationType.Silu.value, quant_type=QuantType.No.value,
                    a1_scale=None, w1_scale=None, sorted_weights=None):
    """AITER's asm stage 1 (``asm_stage1``); with ``ksplit > 0`` it writes the fp32 gate/up rows."""
    if ksplit > 0:
        token_num = out.shape[0]
        rows = out.view(torch.float32).view(token_num * out.shape[1], -1)
        _gemm_rows(input, a1_scale, w1, w1_scale, sorted_token_ids, sorted_expert_ids, num_valid_ids, rows,
                   out.shape[1], token_num, block_m, sorted_weights)
        return
    _stage1_activated(input, w1, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, out.shape[1], block_m,
                      a1_scale, w1_scale, sorted_weights, activation)


def ck_moe_stage2_fwd(inter_states, w1, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                      kernelName="", w2_scale=None, a2_scale=None, block_m=32, sorted_weights=None,
                      quant_type=QuantType.No, activation=ActivationType.Silu, use_non_temporal_load=False):
    """AITER ``ck_moe_stage2_fwd``: the down GEMM, atomically added into the sort's zeroed ``out``."""
    _leaf.moe_stage2(inter_states, w2, sorted_token_ids, sorted_expert_ids, num_valid_ids, out, topk,
                     token_num=out.shape[0], block_m=block_m, a2_scale=a2_scale, w2_scale=w2_scale,
                     sorted_weights=sorted_weights, mode="atomic")
    return out


def moe_cktile2stages_gemm1(XQ, WQ, Y, sorted_ids, sorted_expert_ids, max_token_ids, topk, n_padded_zeros=0,
                            k_padded_zeros=0, topk_weight=None, x_scale=None, w_scale=None, exp_bias=None,
                            activation=0, block_m=32, split_k=1, kernel_name=""):
    """AITER's CK-Tile gate/up GEMM. ``split_k > 1``: the raw gate/up rows into ``Y``
    ``[token*topk, 2*inter]`` (the caller applies the activation); else the activation fused."""
    if split_k and split_k > 1:
        token_num = XQ.shape[0]
        _gemm_rows(XQ, x_scale, WQ, w_scale, sorted_ids, sorted_expert_ids, max_token_ids, Y.view(-1, Y.shape[-1]),
                   topk, token_num, block_m, topk_weight)
        return Y
    _stage1_activated(XQ, WQ, sorted_ids, sorted_expert_ids, max_token_ids, Y, topk, block_m, x_scale, w_scale,
                      topk_weight, activation)
    return Y


def moe_cktile2stages_gemm2(XQ, WQ, Y, sorted_ids, sorted_expert_ids, max_token_ids, topk, n_padded_zeros=0,
                            k_padded_zeros=0, topk_weight=None, x_scale=None, w_scale=None, exp_bias=None,
                            activation=0, block_m=32, split_k=1, kernel_name=""):
    """AITER's CK-Tile down GEMM (atomic into ``Y``)."""
    _leaf.moe_stage2(XQ, WQ, sorted_ids, sorted_expert_ids, max_token_ids, Y, topk, token_num=Y.shape[0],
                     block_m=block_m, a2_scale=x_scale, w2_scale=w_scale, sorted_weights=topk_weight, mode="atomic")
    return Y
