"""``aiter-patches verify --model NAME`` (issue 33): the self-check at every token bucket of a model preset.

On CPU with the stand-in, at a small preset (the real ones take minutes in Triton's interpreter):
each bucket is a new plan, checked against AITER's sort + quant; a fault at one bucket shows as FAIL
there and the patch stands down. Bad arguments end in one line, exit 2.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiter_patches import registry, verify_model
from aiter_patches.amd import presets

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU Triton's interpreter runs the kernels (conftest)


@pytest.fixture
def tiny(monkeypatch):
    shape = presets.ModelShape("Tiny", routing=((16, 4),), hidden=256, max_tokens=3)
    monkeypatch.setitem(presets.PRESETS, "Tiny", shape)
    yield shape
    registry.revert()


def test_every_bucket_is_checked(tiny):
    rows, used = verify_model.run("Tiny", DEVICE)
    assert "stand-in" in used
    assert [(r["quant"], r["tokens"], r["result"]) for r in rows] == [
        (q, m, "ok") for q in ("MXFP4", "MXFP8") for m in presets.token_counts(3, 4)]


def test_a_fault_at_one_bucket_fails_there_and_stands_the_patch_down(tiny, monkeypatch):
    from aiter_patches.kernels import moe_sort_mx_quant as kernel

    real = kernel.moe_sort_mx_quant

    def wrong_at_two_tokens(*a, **k):
        res = real(*a, **k)
        if a[0].shape[0] == 2:
            res.sorted_ids[0] ^= 1
        return res

    monkeypatch.setattr(kernel, "moe_sort_mx_quant", wrong_at_two_tokens)
    rows, _ = verify_model.run("Tiny", DEVICE)
    got = [(r["quant"], r["tokens"], r["result"]) for r in rows]
    assert got[:3] == [("MXFP4", 1, "ok"), ("MXFP4", 2, "FAIL"), ("MXFP4", 3, "SKIP")]
    assert "sorted_ids differs" in rows[1]["detail"]


@pytest.mark.parametrize("args, message", [
    (("--model", "llama"), "aiter-patches verify: --model: unknown model 'llama'; presets: DeepSeek-V3, "
                           "Qwen3-235B-A22B, MiniMax-M3, Kimi-K3"),
    (("--model", "kimi-k3", "--max-tokens", "0"), "aiter-patches verify: --max-tokens 0: the rule is a whole "
                                                  "number, 1 or more"),
    (("--max-tokens", "5"), "aiter-patches verify: --max-tokens needs --model"),
])
def test_bad_arguments_end_in_one_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "aiter_patches", "verify", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, message, "")


def test_block_sizes_follow_aiters_choices():
    assert [verify_model.block_for(m) for m in (1, 1023, 1024, 8191, 8192)] == [32, 32, 64, 64, 128]
    assert torch.float4_e2m1fn_x2  # the MXFP4 dtype the rows name exists in this torch
