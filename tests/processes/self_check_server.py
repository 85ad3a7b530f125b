"""A stand-in server for the self-check across processes: two spawned workers, each serving MXFP4 ``fused_moe``.

Each worker meets one new plan, checked against AITER's sort and quant on its first call (the
self-check is forced on by the test's environment), then served by the fast path; it prints
nothing itself: the stats line each process writes at exit carries its checks.
"""

import multiprocessing as mp
import sys

import torch
from aiter.fused_moe import fused_moe


def _inputs(rank):
    import aiter

    from aiter_patches.patches import checks

    return checks.mxfp4_moe_inputs(aiter, torch.device("cpu"), M=3, E=8, topk=2, dim=256, inter=128, seed=rank)


def worker(rank):
    args = _inputs(rank)
    first = fused_moe(**args)
    again = fused_moe(**args)
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank,)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    sys.exit(max(p.exitcode or 0 for p in procs))
