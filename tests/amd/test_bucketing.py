"""One model configuration compiles a fixed few variants, whatever the batch sizes.

The constexprs the sort launch derives from the batch depend only on the token count's bucket
(``_batch_params``); captured through the real launch path, every token count of 1..600 and
every block size give at most one sort variant per bucket and launch path, and the sampled
token counts of ``presets.token_counts`` find exactly the variants the exhaustive sweep finds.
"""

import json

import pytest

from aiter_patches.kernels import moe_sort_mx_quant as K


@pytest.mark.parametrize("topk,experts,hidden", [(8, 256, 7168), (16, 896, 3584), (5, 129, 6144), (9, 257, 7168)])
def test_batch_params_depend_only_on_the_bucket(topk, experts, hidden):
    e_bins, k_pad, g_pad = K.expert_bin_count(experts), K._next_pow2(topk), K._next_pow2(hidden // 32)
    constexprs = {}
    for m in range(1, 6000):
        p = K._batch_params(m, topk, e_bins, k_pad, g_pad, True, hidden)
        constexprs.setdefault(tuple(sorted((k, v) for k, v in p.items() if k != "split")), []).append(m)
    assert len(constexprs) <= len(K.TOKEN_BUCKETS) + 1
    for ms in constexprs.values():  # each set of constexprs serves one contiguous range of token counts
        assert ms == list(range(ms[0], ms[-1] + 1))


_SWEEP = r"""
import json
from aiter_patches.amd import command, presets
shape = presets.parse_shapes("experts=17,topk=5,hidden=256,quant=fp4/none,ep=off,buf=zero")
ex, _ = command.capture_all([shape], ["gfx942"], tokens=list(range(1, 601)))
shape600 = presets.parse_shapes("experts=17,topk=5,hidden=256,tokens=600,quant=fp4/none,ep=off,buf=zero")
sampled, errors = command.capture_all([shape600], ["gfx942"])
per = {}
for v in ex:
    if v.qualname == "_sort_quant_kernel":
        for c in v.configs:
            per[c] = per.get(c, 0) + 1
print(json.dumps({"exhaustive": sorted(v.key for v in ex), "sampled": sorted(v.key for v in sampled),
                  "errors": errors, "sort_per_config": per}))
"""


@pytest.mark.slow_ci  # 600 token counts captured through the launch path; the bucket rule itself: the test above
def test_sampled_token_counts_find_every_variant_and_few_per_config(run_python):
    r = run_python(["-c", _SWEEP], timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert not got["errors"]
    assert got["sampled"] == got["exhaustive"]
    # every block size (32/64/128, 16 too without quant) and token count 1..600: one sort variant per
    # bucket of the one-launch path (4, 16, 64, 256 and 409 tokens: 2048 pairs) plus the four-launch one
    assert got["sort_per_config"] and max(got["sort_per_config"].values()) <= len(K.TOKEN_BUCKETS) + 1
