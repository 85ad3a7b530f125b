"""Torch reference of AITER's MoE sort output contract (the opus sort, `moe_sorting_opus.h`).

Why a reference: the Triton sort must produce the same bytes as AITER's HIP sort over the
positions AITER defines, and this file states that contract once, in plain torch.

Contract (aiter-facts.md "Sort output contract", checked against `moe_sorting_opus.h`):

* ``T`` is the token count: ``num_local_tokens[0]`` when given, else ``M``. Only tokens
  ``< T`` are sorted and only ``moe_buf`` rows ``< T`` zeroed, with ``T`` clamped to ``[0, M]``
  for that (AITER reads ``topk_ids`` and zeroes ``moe_buf`` out of bounds past ``M``: undefined,
  so the reference stops at ``M``; below 0 AITER does nothing, as here). ``num_valid_ids[1]``
  and the padding ids hold the value as given, as AITER's kernel writes them.
* A pair ``(token, slot)`` is kept when its expert id ``e`` satisfies ``0 <= e < num_experts``
  and, under EP, ``expert_mask[e] != 0``. Out-of-range ids are **dropped** (AITER's kernel
  indexes its LDS table with them: undefined and unsafe, so there is no behaviour to copy).
* Kept pairs are grouped by ascending expert; inside an expert they keep the flattened
  ``token * topk + slot`` order. Each pair is its own entry, also when one token names the
  same expert twice (AITER's HIP sort collapses such duplicates racily; not a defined result).
* ``sorted_ids`` holds ``(slot << 24) | token``; each expert's segment is padded to a multiple
  of ``block_size`` with ``(topk << 24) | (T & 0xFFFFFF)`` and weight ``0.0``. Experts with no pair get no block.
* ``sorted_expert_ids[b]`` is the expert of block ``b``: the local id under EP, i.e. the
  exclusive cumsum of the raw mask values (AITER sums the mask values, it does not count
  nonzeros), else the global id.
* ``num_valid_ids = [sum of padded segment sizes, T]``.
* Positions ``>= num_valid_ids[0]`` of ``sorted_ids``/``sorted_weights`` and blocks
  ``>= num_valid_ids[0] // block_size`` are not written by AITER (``torch.empty``): see
  :func:`defined_sort_region`. This reference fills them with ``UNDEFINED_ID`` / NaN / -1.

The Triton kernel refuses ``num_experts < topk`` (then duplicate ids could need more slots than
AITER's buffer size formula provides); with ``num_experts >= topk`` every layout fits.
"""

from __future__ import annotations

import torch

from ..aiter_contract import TOKEN_BITS, sort_buffer_sizes  # noqa: F401  (sort_buffer_sizes re-exported)

UNDEFINED_ID = -1


def local_expert_ids(num_experts: int, expert_mask: torch.Tensor | None, device=None) -> torch.Tensor:
    """Id written to ``sorted_expert_ids`` for each global expert: exclusive cumsum of the mask."""
    if expert_mask is None:
        return torch.arange(num_experts, dtype=torch.int64, device=device)
    m = expert_mask[:num_experts].to(torch.int64)
    return torch.cumsum(m, 0) - m


def token_count(num_tokens: int, num_local_tokens: torch.Tensor | None) -> int:
    """``T``: the number of tokens the sort looks at (see module docstring)."""
    if num_local_tokens is None:
        return num_tokens
    return min(max(int(num_local_tokens.reshape(-1)[0]), 0), num_tokens)


def token_count_as_given(num_tokens: int, num_local_tokens: torch.Tensor | None) -> int:
    """``T`` unclamped: what AITER writes to ``num_valid_ids[1]`` and the padding ids."""
    if num_local_tokens is None:
        return num_tokens
    return int(num_local_tokens.reshape(-1)[0])


def kept_pairs(topk_ids: torch.Tensor, num_experts: int, expert_mask: torch.Tensor | None,
               num_tokens: int) -> torch.Tensor:
    """Bool ``[num_tokens * topk]``: which flattened pairs of the first ``num_tokens`` tokens are sorted."""
    ids = topk_ids[:num_tokens].reshape(-1).to(torch.int64)
    keep = (ids >= 0) & (ids < num_experts)
    if expert_mask is not None:
        keep &= expert_mask.to(torch.int64)[ids.clamp(0, max(num_experts - 1, 0))] != 0
    return keep


def moe_sorting_reference(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_mask: torch.Tensor | None = None,
    num_local_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids)`` at AITER's sizes."""
    M, topk = topk_ids.shape
    dev = topk_ids.device
    n_ids, n_blocks = sort_buffer_sizes(M * topk, topk, num_experts, block_size)
    T = token_count(M, num_local_tokens)

    sorted_ids = torch.full((n_ids,), UNDEFINED_ID, dtype=torch.int32, device=dev)
    sorted_weights = torch.full((n_ids,), float("nan"), dtype=torch.float32, device=dev)
    sorted_expert_ids = torch.full((n_blocks,), UNDEFINED_ID, dtype=torch.int32, device=dev)

    ids = topk_ids[:T].reshape(-1).to(torch.int64)
    weights = topk_weights[:T].reshape(-1).to(torch.float32)
    flat = torch.arange(T * topk, dtype=torch.int64, device=dev)
    keep = kept_pairs(topk_ids, num_experts, expert_mask, T)
    ids, weights, flat = ids[keep], weights[keep], flat[keep]

    counts = torch.bincount(ids, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    seg_start = torch.cumsum(padded, 0) - padded
    cnt_start = torch.cumsum(counts, 0) - counts

    order = torch.sort(ids, stable=True).indices  # stable: flattened order inside an expert
    e_sorted, f_sorted = ids[order], flat[order]
    rank = torch.arange(e_sorted.numel(), device=dev) - cnt_start[e_sorted]
    pos = seg_start[e_sorted] + rank
    sorted_ids[pos] = (((f_sorted % topk) << TOKEN_BITS) | (f_sorted // topk)).to(torch.int32)
    sorted_weights[pos] = weights[order]

    T_given = token_count_as_given(M, num_local_tokens)
    pad_id = (topk << TOKEN_BITS) | (T_given & ((1 << TOKEN_BITS) - 1))
    for e in torch.nonzero(counts).flatten().tolist():
        lo, hi = int(seg_start[e] + counts[e]), int(seg_start[e] + padded[e])
        sorted_ids[lo:hi] = pad_id
        sorted_weights[lo:hi] = 0.0

    lids = local_expert_ids(num_experts, expert_mask, dev)
    sorted_expert_ids_used = torch.repeat_interleave(lids, padded // block_size)
    sorted_expert_ids[: sorted_expert_ids_used.numel()] = sorted_expert_ids_used.to(torch.int32)

    num_valid_ids = torch.tensor([int(padded.sum()), T_given], dtype=torch.int32, device=dev)
    return sorted_ids, sorted_weights, sorted_expert_ids, num_valid_ids


def defined_sort_region(num_valid_ids: torch.Tensor, block_size: int) -> tuple[int, int]:
    """``(n_ids, n_blocks)``: leading positions of sorted_ids/weights and sorted_expert_ids AITER writes."""
    n_ids = int(num_valid_ids[0])
    return n_ids, n_ids // block_size
