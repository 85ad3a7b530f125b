"""The precompiled cache is the cache a ROCm server looks up: same keys, zero compiles.

``aiter-patches compile --cache-dir`` compiles from a fake driver reporting ``gfx942``; a
serving process whose driver reports what a real HIP driver reports
(``gfx942:sramecc+:xnack-``) then runs the same launcher calls through ``JITFunction.run``
and must hit the cache for every kernel and compile nothing. The same serving process
pointed at a cache built for another arch must miss (the check can fail).
"""

import json
from pathlib import Path

SHAPES = "experts=8,topk=2,hidden=64,quant=fp4,ep=off,buf=zero,blocks=32/64,tokens=3"
TOKENS = [1, 2, 3]


def _precompile(run_python, cache: Path, arch: str):
    r = run_python(["-m", "aiter_patches", "compile", "--arch", arch, "--shapes", SHAPES, "--cache-dir",
                    str(cache), "--jobs", "1"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _serve(run_python, cache: Path, arch_string: str) -> dict:
    script = str(Path(__file__).with_name("serve_from_cache.py"))
    cfg = json.dumps({"shapes": SHAPES, "tokens": TOKENS})
    r = run_python([script, arch_string, cfg], timeout=300, TRITON_CACHE_DIR=str(cache))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _stored_hashes(cache: Path) -> set:
    """The cache key (metadata hash) of every kernel the precompile stored."""
    out = set()
    for meta in cache.glob("*/*.json"):
        if not meta.name.startswith("__grp__"):
            out.add(json.loads(meta.read_text())["hash"])
    return out


def test_server_hits_the_precompiled_cache_with_no_compile(run_python, tmp_path):
    cache = tmp_path / "cache"
    _precompile(run_python, cache, "gfx942")
    stored = _stored_hashes(cache)
    assert stored

    served = _serve(run_python, cache, "gfx942:sramecc+:xnack-")
    assert served["target"] == ["hip", "gfx942", 64]  # triton dropped the feature suffixes
    assert served["calls"] == 2 * len(TOKENS) and served["launches"] == served["calls"]
    assert served["misses"] == 0
    assert served["compiles"] and all(c["cache_hit"] for c in served["compiles"])
    # the keys run looked up are exactly the keys the precompile stored
    assert {c["hash"] for c in served["compiles"]} == stored


def test_a_cache_for_another_arch_is_missed(run_python, tmp_path):
    cache = tmp_path / "cache"
    _precompile(run_python, cache, "gfx950")
    served = _serve(run_python, cache, "gfx942:sramecc+:xnack-")
    assert served["misses"] == served["calls"] > 0
