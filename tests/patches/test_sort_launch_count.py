"""The launch count the sort-only rule compares with AITER's is the kernel module's own, checked
against counted launches: one up to ONE_LAUNCH_MAX_PAIRS pairs (fewer with many experts:
ONE_LAUNCH_MAX_PAIR_BINS), then three (rank, scan, sort), four with the split-semantics quant (its scale tiles)."""

import pytest
import torch

from aiter_patches.kernels import moe_sort_mx_quant as k
from aiter_patches.patches import moe_sort_mx_quant as msq


def _counted(monkeypatch, M, topk, quant_dtype=None, semantics="auto", E=64):
    names = []
    monkeypatch.setattr(k, "launch", lambda fn, grid, *a, **kw: names.append(fn.__name__))
    ids = (torch.arange(M * topk, dtype=torch.int32) % E).reshape(M, topk)
    w = torch.rand(M, topk)
    quant = {}
    if quant_dtype is not None:
        quant = dict(quant_input=torch.zeros(M, 64, dtype=torch.bfloat16), quant_dtype=quant_dtype,
                     quant_semantics=semantics)
    k.moe_sort_mx_quant(ids, w, E, 128, torch.bfloat16, 32, **quant)
    return names


@pytest.mark.parametrize("M,topk,qd,sem,fused,n", [
    (256, 8, None, "auto", False, 1),                      # exactly ONE_LAUNCH_MAX_PAIRS pairs
    (257, 8, None, "auto", False, 3),                      # sort only above it
    (4096, 1, None, "auto", False, 3),
    (300, 8, torch.float4_e2m1fn_x2, "split", False, 4),   # + the scale tiles
    (300, 8, torch.float8_e4m3fn, "auto", False, 4),       # auto above 2048 pairs is split
    (300, 8, torch.float4_e2m1fn_x2, "fused", True, 3),
    (16, 8, torch.float4_e2m1fn_x2, "split", False, 1),
])
def test_launch_count_is_what_the_kernel_launches(monkeypatch, M, topk, qd, sem, fused, n):
    assert len(_counted(monkeypatch, M, topk, qd, sem)) == n
    assert k.launch_count(M, topk, 64, quant=qd is not None, fused=fused) == n


@pytest.mark.parametrize("M,topk,E,qd,n", [
    (32, 16, 896, None, 1),                          # 512 pairs: the decode sort's (512 per 1024 bins)
    (33, 16, 896, None, 3),                          # 528 pairs x 1024 bins, past 2^19 pair-bins: prescanned
    (33, 16, 896, torch.float4_e2m1fn_x2, 3),        # auto up to 2048 pairs is fused: no scale tiles
    (128, 8, 256, torch.float8_e4m3fn, 1),           # 1024 pairs x 512 bins: the count
    (129, 8, 256, None, 3),
    (256, 8, 128, None, 1),                          # 256 bins: one launch up to 2048 pairs
    (33, 16, 2048, None, 1),                         # 4096 bins: the decode methods take 2048 (per bin): one launch
])
def test_many_experts_take_the_prescanned_launches_from_fewer_pairs(monkeypatch, M, topk, E, qd, n):
    """With 512 and more expert bins the per-program count of every pair into every bin passes
    ONE_LAUNCH_MAX_PAIR_BINS before ONE_LAUNCH_MAX_PAIRS: the prescanned launches take the batch."""
    assert len(_counted(monkeypatch, M, topk, qd, "auto", E)) == n
    assert k.launch_count(M, topk, E, quant=qd is not None, fused=M * topk <= k.FUSED_QUANT_MAX_PAIRS) == n


@pytest.mark.parametrize("M,topk,theirs,saves", [(256, 8, 2, True), (2048, 2, 4, True), (2048, 2, 3, False),
                                                 (257, 8, 2, False)])
def test_sort_only_runs_where_its_counted_launches_are_fewer(monkeypatch, M, topk, theirs, saves):
    monkeypatch.setattr(msq, "aiter_sort_launches", lambda *a: theirs)
    bound = {"topk_ids": torch.zeros(M, topk, dtype=torch.int32), "num_experts": 64}
    reason = msq.sort_only_reason(bound, k)
    ours = k.launch_count(M, topk, 64, quant=False, fused=False)
    assert (reason is None) == saves
    if not saves:
        assert reason.endswith(f"takes {theirs} launch(es), the one-launch sort {ours}")


def test_aiters_workspace_answers_are_kept_up_to_a_cap(monkeypatch):
    """AITER's opus workspace size is asked once per shape and kept, at most WORKSPACE_CAP shapes (issue 35
    item 9: 2,600 token counts kept 2,600): past the cap it is asked each time, with the same answers."""
    import types

    asked = []

    def workspace(tokens, experts, topk, policy):
        asked.append(tokens)
        return 0 if tokens % 3 == 0 else 64

    monkeypatch.setattr(msq.moe_call, "aiter_module", lambda name="aiter": types.SimpleNamespace(
        moe_sorting_opus_get_workspace_size=workspace))
    monkeypatch.setattr(msq, "_OPUS_WORKSPACE", {})
    n = msq.WORKSPACE_CAP + 500
    for tokens in range(1, n + 1):
        want = 1 if tokens % 3 == 0 else (2 if tokens < msq.SORT_FOUR_LAUNCHES_MIN_TOKENS else 4)
        assert msq.aiter_sort_launches(tokens, 64, 8, 0) == want
    assert len(msq._OPUS_WORKSPACE) == msq.WORKSPACE_CAP == 1024
    asked.clear()
    msq.aiter_sort_launches(1, 64, 8, 0)  # kept
    msq.aiter_sort_launches(n, 64, 8, 0)  # past the cap: asked again
    assert asked == [n]
