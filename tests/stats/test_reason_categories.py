"""Fallback reasons name categories, never a call's own values (issue 35 item 3): each reason the kernels' gates
and the integrations give for a token count, a shape or a size stays one text over calls of many sizes, and the
values of the first call that met it go to one DEBUG line (``reasons.with_values``). Metadata only: the tensors
are on the meta device, nothing is allocated or launched."""

import logging
import sys
import types

import pytest
import torch

from aiter_patches import reasons
from aiter_patches.integrations import addend_offer
from aiter_patches.integrations import sglang_zero_pool as pool_mod
from aiter_patches.kernels import hip_blockscale_asm as hb
from aiter_patches.kernels import moe_sort_mx_quant as k

META = dict(device="meta")
TOKENS = range(1, 3001, 7)  # ~430 distinct batch sizes


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(reasons, "_logged", set())


def _sort_gate(M, **change):
    ids = torch.empty(M, 8, dtype=torch.int32, **META)
    gate = dict(topk_ids=ids, topk_weights=torch.empty(M, 8, **META), num_experts=256, model_dim=7168,
                block_size=32, expert_mask=None, num_local_tokens=None, quant_input=None, quant_dtype=None,
                moe_buf=None, moe_buf_init=None)
    gate.update({key: f(M) for key, f in change.items()})
    return gate


SORT_CASES = {
    "moe_buf rows": dict(moe_buf=lambda M: torch.empty(M + 1, 7168, dtype=torch.bfloat16, **META)),
    "moe_buf_init columns": dict(moe_buf_init=lambda M: torch.empty(M, 7168 + M, dtype=torch.bfloat16, **META)),
    "model_dim x tokens": dict(model_dim=lambda M: (1 << 31) // M + 1),
    "quant width": dict(quant_input=lambda M: torch.empty(1, 32 * 7000 + 32 * M, dtype=torch.bfloat16, **META),
                        quant_dtype=lambda M: torch.float8_e4m3fn),
}


@pytest.mark.parametrize("case", sorted(SORT_CASES))
def test_the_sort_gate_gives_one_reason_over_many_batch_sizes(case, caplog):
    change = SORT_CASES[case]
    if case == "quant width":  # one token of a width past the kernel's limit, the width growing per call
        change = dict(change, topk_ids=lambda M: torch.empty(1, 8, dtype=torch.int32, **META),
                      topk_weights=lambda M: torch.empty(1, 8, **META))
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = {k.unsupported_reason(**_sort_gate(M, **change)) for M in TOKENS}
    assert len(got) == 1 and None not in got, got
    (reason,) = got
    first = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert len(first) == 1 and "first call: " in first[0], first


def test_the_sort_gate_past_the_token_limits_gives_one_reason(caplog):
    big = [(1 << 24) + i for i in range(0, 400_000, 997)]
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = {k.unsupported_reason(**_sort_gate(M)) for M in big}
    assert got == {"tokens do not fit the 24-bit token field"}
    assert f"tokens={big[0]}" in caplog.text and f"tokens={big[1]}" not in caplog.text


def _gemm(M, N=256, K=512):
    fp8 = torch.float8_e4m3fn
    return dict(A=torch.empty(M, K, dtype=fp8, **META), B=torch.empty(N, K, dtype=fp8, **META),
                out=torch.empty(M, N, dtype=torch.bfloat16, **META),
                A_scale=torch.empty(M, K // 128, **META), B_scale=torch.empty(N // 128, K // 128, **META))


GEMM_CASES = {
    "out rows": lambda M: dict(_gemm(M), out=torch.empty(M + 1, 256, dtype=torch.bfloat16, **META)),
    "N not a multiple": lambda M: _gemm(M, N=128 * (M % 5 + 1) + 64),
    "A_scale size": lambda M: dict(_gemm(M), A_scale=torch.empty(M + 1, 4, **META)),
    "device": lambda M: dict(_gemm(M), out=torch.empty(M, 256, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_the_gemm_gate_gives_one_reason_over_many_batch_sizes(case, caplog):
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = {hb.unsupported_reason(**GEMM_CASES[case](M)) for M in TOKENS}
    assert len(got) == 1 and None not in got, got
    assert sum(next(iter(got)) in r.getMessage() for r in caplog.records) == 1


def test_the_addend_offer_gives_one_reason_over_many_batch_sizes(caplog):
    def bound(M):
        return dict(hidden_states=torch.empty(M, 16, dtype=torch.bfloat16, **META),
                    topk_ids=torch.empty(M, 2, dtype=torch.int32, **META), w2=torch.empty(4, 16, 8, **META))

    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        got = {addend_offer.reason(bound(M), [], torch.empty(M, 32, dtype=torch.bfloat16, **META), True,
                                   lambda d: "s", "s") for M in TOKENS}
    assert len(got) == 1 and None not in got, got
    assert "[1, 16]" in caplog.text and "[8, 16]" not in caplog.text  # the first call's shape only


def test_an_unreadable_tuned_config_gives_one_reason(monkeypatch):
    def config(M, N, K, tuned):
        raise KeyError(f"no row for M={M}")

    monkeypatch.setitem(sys.modules, pool_mod.dispatch.MODULE, types.SimpleNamespace(get_CKGEMM_config=config))
    monkeypatch.setattr(pool_mod, "_split_cache", {})
    got = {pool_mod.asm_split_reason(M, 7168, 2048) for M in range(1, pool_mod.MAX_M + 1)}
    assert got == {"cannot read AITER's tuned config: KeyError"}


def test_a_device_without_triton_is_one_reason_whatever_its_index():
    from aiter_patches import runtime

    got = {runtime.triton_backend_reason(torch.device("xpu", i)) for i in range(8)}
    assert got == {"tensors on xpu: no Triton backend there (TRITON_INTERPRET=1 runs the kernels on CPU)"}


def test_the_values_logged_are_bounded_too(caplog):
    with caplog.at_level(logging.DEBUG, logger="aiter_patches"):
        for i in range(reasons.MAX_LOGGED + 100):
            assert reasons.with_values(f"category {i}", n=i) == f"category {i}"
    assert len(reasons._logged) == reasons.MAX_LOGGED
    assert len(caplog.records) == reasons.MAX_LOGGED
