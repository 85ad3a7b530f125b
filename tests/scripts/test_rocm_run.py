"""What of the AMD evidence run can be checked without an AMD GPU.

`scripts/rocm_run.sh` itself (syntax, dry run, a failing / timing-out / missing step recorded
while the run goes on, the exit status), the report writer on fake steps, the serving-loop
counter's verdicts, the benchmark's rows (the docs/bench shapes), and the code-object check
script on AITER's real files.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.aiter_tree import code_object_root, gemm_kernel_dir

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "scripts" / "rocm_run.sh"
STEPS = ["env", "gpu-tests", "verify", "code-objects", "precompile", "serving-loop", "bench"]


def load(relpath: str):
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def run_script(tmp_path, *args, python=sys.executable, **env):
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(python), "ARCH": "gfx950", **env}
    return subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=120, env=full,
                          cwd=tmp_path)


def steps_tsv(tmp_path):
    return [line.split("\t") for line in (tmp_path / "out" / "steps.tsv").read_text().splitlines()]


def test_shell_syntax():
    assert subprocess.run(["bash", "-n", str(RUN)], capture_output=True).returncode == 0


def test_dry_run_prints_every_step_and_writes_the_report(tmp_path):
    res = run_script(tmp_path, "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    for name in STEPS:
        assert f"[dry-run] {name}: " in res.stdout
    assert "compile --arch gfx950 --model deepseek-v3 --cache-dir" in res.stdout
    assert [row[:2] for row in steps_tsv(tmp_path)] == [[n, "DRY-RUN"] for n in STEPS]
    report = (tmp_path / "out" / "rocm_report.md").read_text()
    assert "**dry run: nothing was measured**" in report
    for label in ("| GPU |", "| ROCm |", "| torch |", "| triton |", "| AITER |", "| aiter_patches |"):
        assert label in report
    assert not (tmp_path / "out" / "triton-cache").exists()


def test_unknown_step_is_an_error(tmp_path):
    res = run_script(tmp_path, "benchmark")
    assert res.returncode == 2 and "unknown step: benchmark" in res.stdout


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python: the report writer is real, every measured step is faked
case "$*" in
  *"rocm_report.py --steps"*) exec {real} "$@" ;;
  *"-m pytest"*) echo "1 failed, 216 passed"; exit 1 ;;
  *"compile --help"*) exit {compile_help} ;;
  *"-m aiter_patches compile"*) mkdir -p "${{@: -1}}" ;;
  *"-m aiter_patches verify"*) sleep 5 ;;
  *serving_loop_compiles.py*) echo "PASS: 0 JIT compiles: all 12 kernel variants came from the cache" ;;
  *bench_vs_aiter_rocm.py*) echo "| fake | table |" > "${{@: -1}}"; echo benched ;;
  *) echo "fake python: $*" ;;
esac
"""


def fake_python(tmp_path, compile_help=0):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON.format(real=sys.executable, compile_help=compile_help))
    path.chmod(0o755)
    return path


def test_failures_are_recorded_and_the_run_goes_on(tmp_path):
    res = run_script(tmp_path, python=fake_python(tmp_path), STEP_TIMEOUT="1")
    assert res.returncode == 1, res.stdout + res.stderr
    got = {row[0]: row[1] for row in steps_tsv(tmp_path)}
    assert got == {"env": "PASS", "gpu-tests": "FAIL", "verify": "TIMEOUT", "code-objects": "PASS",
                   "precompile": "PASS", "serving-loop": "PASS", "bench": "PASS"}
    report = (tmp_path / "out" / "rocm_report.md").read_text()
    assert "**2 step(s) failed: gpu-tests, verify**" in report
    assert "## gpu-tests: FAIL" in report and "1 failed, 216 passed" in report
    assert "## verify: TIMEOUT" in report and "exit status 124" in report
    assert "## bench: PASS" in report and "| fake | table |" in report  # the benchmark's file, inlined


def test_missing_compile_command_fails_precompile_and_skips_the_loop(tmp_path):
    res = run_script(tmp_path, "precompile", "serving-loop", python=fake_python(tmp_path, compile_help=2))
    assert res.returncode == 1, res.stdout + res.stderr
    assert [row[:2] for row in steps_tsv(tmp_path)] == [["precompile", "FAIL"], ["serving-loop", "SKIP"]]
    report = (tmp_path / "out" / "rocm_report.md").read_text()
    assert "this aiter_patches has no 'compile' command" in report
    assert "Skipped: the precompile step did not pass (FAIL)" in report


def test_a_precompile_that_leaves_no_cache_fails_the_loop(tmp_path):
    fake = fake_python(tmp_path)
    fake.write_text(fake.read_text().replace('mkdir -p "${@: -1}"', "true"))
    res = run_script(tmp_path, "precompile", "serving-loop", python=fake)
    assert res.returncode == 1
    assert [row[:2] for row in steps_tsv(tmp_path)] == [["precompile", "PASS"], ["serving-loop", "FAIL"]]
    assert "passed but left no cache" in (tmp_path / "out" / "rocm_report.md").read_text()


def test_all_passing_steps_exit_zero(tmp_path):
    res = run_script(tmp_path, "code-objects", "bench", python=fake_python(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "**every step passed**" in (tmp_path / "out" / "rocm_report.md").read_text()


# ---------------------------------------------------------------- the report writer


def test_report_shows_tails_attachments_and_skips(tmp_path):
    rr = load("scripts/rocm_report.py")
    (tmp_path / "gpu-tests.log").write_text("\n".join(f"line {i}" for i in range(100)) + "\n~~~ fence\n")
    (tmp_path / "code-objects.log").write_text("\n".join(f"| gfx942 | k{i}.co | accepted |" for i in range(50)))
    (tmp_path / "bench.log").write_text("benched\n")
    (tmp_path / "bench_vs_aiter.md").write_text("## Block-scale\n| M | N |\n")
    steps = [rr.Step("gpu-tests", "FAIL", "812", "1", "python -m pytest -m gpu", "gpu-tests.log"),
             rr.Step("code-objects", "PASS", "2", "0", "python scripts/check_code_objects.py", "code-objects.log"),
             rr.Step("serving-loop", "SKIP", "0", "-", "-", "no precompiled cache"),
             rr.Step("bench", "PASS", "600", "0", "python bench/bench_vs_aiter_rocm.py", "bench.log")]
    env = {"GPU": "AMD Instinct MI300X (gfx942:sramecc+:xnack-, 304 CUs, 192 GiB) x8", "AITER": "0.1.20 | x"}
    text = rr.render(env, steps, tmp_path, "deepseek-v3", "gfx942")
    assert "**1 step(s) failed: gpu-tests**" in text
    assert "| AITER | 0.1.20 / x |" in text  # a '|' in a value would break the table
    assert "| gpu-tests | FAIL | 812 | 1 |" in text
    assert "Last 40 of 101 log lines:" in text and "line 99" in text and "line 60" not in text
    assert "~ ~ ~ fence" in text  # the log cannot close the fence early
    assert "k0.co" in text and "k49.co" in text  # short logs whole
    assert "Skipped: no precompiled cache" in text
    assert "## Block-scale\n| M | N |" in text


def test_preflight_problems():
    rr = load("scripts/rocm_report.py")
    ok = {"ROCm": "torch.version.hip 6.4.1", "GPU": "AMD Instinct MI355X x8", "AITER": "0.1.20 at /x"}
    assert rr.preflight_problems(ok) == []
    bad = {"ROCm": "torch is not a ROCm build", "GPU": "none visible to torch", "AITER": "not usable: no aiter"}
    assert len(rr.preflight_problems(bad)) == 3


# ---------------------------------------------------------------- the serving loop and the benchmark


def test_compile_counter_verdicts():
    sl = load("scripts/serving_loop_compiles.py")
    c = sl.CompileCount()
    assert c.verdict()[0] == 3  # nothing reached: never a vacuous pass
    src = type("Src", (), {"name": "_sort_quant_kernel", "constants": {"BLOCK": 32}})()
    c(src=src, metadata={}, metadata_group={}, times=None, cache_hit=True)
    assert c.verdict() == (0, "0 JIT compiles: all 1 kernel variants came from the cache")
    c(src=src, metadata={}, metadata_group={}, times=None, cache_hit=False)
    assert c.verdict() == (1, "1 JIT compile(s) of 2 kernel variants")
    assert "_sort_quant_kernel" in c.compiled[0] and "BLOCK" in c.compiled[0]
    assert sl.compiled_kernel_file("/c/ab/_sort_quant_kernel.json")
    assert not sl.compiled_kernel_file("/c/ab/__grp___sort_quant_kernel.json")
    assert not sl.compiled_kernel_file("/c/ab/_sort_quant_kernel.hsaco")


@pytest.mark.parametrize("given, name", [("DeepSeek-V3/R1", "deepseek-v3"), ("deepseek-r1", "deepseek-v3"),
                                         ("Qwen3-235B", "qwen3-235b"), ("kimi_k3", "kimi-k3")])
def test_model_presets(given, name):
    sl = load("scripts/serving_loop_compiles.py")
    assert sl.model_shape(given)[0] == name
    with pytest.raises(SystemExit, match="unknown model"):
        sl.model_shape("llama")


def test_serving_loop_says_it_needs_a_gpu(tmp_path):
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "serving_loop_compiles.py"), "--model", "kimi-k3"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 2 and "needs a GPU" in res.stdout
    assert "experts 896, topk 16, hidden 3584" in res.stdout


def test_bench_rows_are_the_docs_bench_shapes():
    sys.path.insert(0, str(REPO))
    bv = load("bench/bench_vs_aiter_rocm.py")
    from bench import bench_moe_sort_quant as s

    assert bv.sort_rows(False) == [(E, K, N, M) for E, K, N in s.MODELS for M in s.DECODE + s.PREFILL]
    assert bv.gemm_rows(False) == [(M, N, K) for N, K in bv.GEMM_SHAPES for M in bv.GEMM_MS]
    assert bv.main(["--dry-run", "--quick"]) == 0


def test_gemm_split_is_one_aiters_launcher_accepts():
    bv = load("bench/bench_vs_aiter_rocm.py")
    from aiter_patches.kernels import hip_blockscale_asm as hb

    kernels = [hb.AsmKernel(t, 128, 1, 1, f"k{t}", f"k{t}.co") for t in (32, 64, 128)]
    for M, N, K in bv.gemm_rows(False):
        split = bv.gemm_split(M, N, K, 304, kernels)
        assert hb.select_kernel(M, N, K, kernels, 304, split)[1] == split


# ---------------------------------------------------------------- the code-object check script


@pytest.fixture(scope="module")
def aiter_root(tmp_path_factory):
    return code_object_root(tmp_path_factory.mktemp("aiter_hsa"))


def test_check_code_objects_script(aiter_root, tmp_path, capsys):
    cc = load("scripts/check_code_objects.py")
    assert cc.main(["--root", str(aiter_root), "--arch", "gfx942,gfx950"]) == 0
    assert capsys.readouterr().out.count("| accepted |") == 12
    bad = tmp_path / "bad"
    shutil.copytree(gemm_kernel_dir(aiter_root, "gfx942"), gemm_kernel_dir(bad, "gfx942"))
    (gemm_kernel_dir(bad, "gfx942") / "fp8gemm_bf16_blockscale_BpreShuffle_64x128.co").write_bytes(b"junk")
    assert cc.main(["--root", str(bad), "--arch", "gfx942"]) == 1
    assert "REFUSED: fp8gemm_bf16_blockscale_BpreShuffle_64x128.co: not an ELF file" in capsys.readouterr().out
    assert cc.main(["--root", str(tmp_path / "none"), "--arch", "gfx942"]) == 2


def test_bench_tables_on_fake_rows():
    bv = load("bench/bench_vs_aiter_rocm.py")
    sort = bv.sort_table([dict(E=256, K=8, N=7168, M=1, patched=4.0, aiter_sort=7.0, aiter_quant=4.0, aiter_chain=11.0),
                          dict(E=256, K=8, N=7168, M=2, patched=None, aiter_error="patched failed: X")],
                         2.5, True)
    assert "| 256 | 8 | 7168 | 1 | 4.00 | 7.00 | 4.00 | 11.00 | 2.75x |" in sort
    assert "| 256 | 8 | 7168 | 2 | n/a | n/a | n/a | n/a | patched failed: X |" in sort
    gemm = bv.gemm_table([dict(M=7, N=7168, K=2048, split=4, aiter=12.0, patched=10.5, memset=1.2, rel_diff=3e-3),
                          dict(M=1, N=7168, K=2048, split=1, aiter=8.0, note="split 1: AITER launches no memset")])
    assert "| 7 | 7168 | 2048 | 4 | 12.00 | 10.50 | 1.50 | 1.20 | 0.88 | 3.0e-03 |  |" in gemm
    assert "| 1 | 7168 | 2048 | 1 | 8.00 | n/a | n/a | n/a | n/a | n/a | split 1: AITER launches no memset |" in gemm
