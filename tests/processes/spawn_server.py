"""A stand-in inference server for tests/processes: a parent and two workers started with multiprocessing spawn.

Like a server module it binds AITER's function with ``from aiter.fused_moe
import fused_moe`` at import time, before any code of its own runs; each
spawned worker re-imports this file as ``__mp_main__`` and does the same.
Each worker then calls ``fused_moe(..., moe_addend=...)``, a keyword only the
addend-fold patch understands, and reports what happened. The parent
prints one JSON line: its pid and the workers' reports.
"""

import json
import multiprocessing as mp
import os
import sys

from aiter.fused_moe import fused_moe

WORKERS = 2


def _inputs(rank):
    import torch

    g = torch.Generator().manual_seed(rank)
    M, E, topk, dim, inter = 2, 4, 2, 64, 32
    ids = torch.rand(M, E, generator=g).argsort(dim=1)[:, :topk].to(torch.int32)
    weights = torch.rand(M, topk, generator=g).softmax(dim=1)
    x = torch.randn(M, dim, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, 2 * inter, dim, generator=g) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, dim, inter, generator=g) / 8).to(torch.bfloat16)
    addend = torch.randn(M, dim, generator=g).to(torch.bfloat16)
    return (x, w1, w2, weights, ids), addend


def worker(rank, queue):
    import aiter_patches  # read-only here: status() and stats() patch nothing
    from aiter_patches.patches.moe_addend_fold import NAME as ADDEND_PATCH

    args, addend = _inputs(rank)
    try:
        plain = fused_moe(*args)
        folded = fused_moe(*args, moe_addend=addend)
        expected = plain.float() + addend.float()
        err = ((folded.float() - expected).abs().max() / expected.abs().max()).item()
        call = "ok" if err <= 1e-2 else f"wrong (relative error {err:.3g})"
    except TypeError as exc:
        call = f"TypeError: {exc}"
    queue.put({
        "rank": rank,
        "pid": os.getpid(),
        "marker": getattr(fused_moe, "__aiter_patches__", None),
        "call": call,
        "fast": aiter_patches.stats()[ADDEND_PATCH]["fast"],
        "states": {p["name"]: p["state"] for p in aiter_patches.status()["patches"]},
    })


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for rank in range(WORKERS):
        os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)  # what the child inherits at start()
        p = ctx.Process(target=worker, args=(rank, queue))
        p.start()
        procs.append(p)
    reports = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    print(json.dumps({"parent": os.getpid(), "workers": sorted(reports, key=lambda r: r["rank"])}))
    sys.exit(max(p.exitcode for p in procs))
