"""A minimal ``vllm`` package around the MoE runner the vLLM integration patches, from vLLM 0.33.0's own files.

``runner/moe_runner.py`` and ``runner/shared_experts.py`` are written here as the
wheel has them, less their ``vllm`` imports, which a head of fakes replaces (the
forward context, the platform: CPU, so ``_select_forward`` returns vLLM's Python
``_moe_forward_shared`` as it does on CPU; collectives are identities at TP 1;
no aux stream), and ``_aiter_ops.py`` holds only vLLM's GEMM op body and fake. Every function
and class body is vLLM's, so the source hashes are
the wheel's. The files come from ``.ci/wheel_members.py``'s small zip of the wheel
(``$AITER_PATCHES_TEST_VLLM_FILES``, or the cache ``.ci/run`` fills). Nothing of
vLLM is copied into the repository.
"""

from __future__ import annotations

import ast
import os
import zipfile
from pathlib import Path

import pytest

from . import server_tree

MEMBERS_NAME = "vllm-0.33.0-members.zip"
ENV = "AITER_PATCHES_TEST_VLLM_FILES"
WHEEL = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
RUNNER = "vllm/model_executor/layers/fused_moe/runner/moe_runner.py"
SHARED = "vllm/model_executor/layers/fused_moe/runner/shared_experts.py"
OPS = "vllm/_aiter_ops.py"
OPS_FUNCTIONS = ("_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl", "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_fake")
FILES = (RUNNER, SHARED, OPS, "vllm/model_executor/kernels/linear/scaled_mm/aiter.py")

_RUNNER_HEAD = '''"""Test tree: vLLM 0.33.0's moe_runner.py (from the wheel) over fakes of what it imports."""
import logging
from types import SimpleNamespace

import torch

from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts, SharedExpertsOrder

_USE_LAYERNAME = False


class LayerName:
    def __init__(self, value):
        self.value = value


FORWARD_CONTEXT = SimpleNamespace(all_moe_layers=None, no_compile_layers={}, dp_metadata=None, moe_layer_index=0)


def get_forward_context():
    return FORWARD_CONTEXT


def is_forward_context_available():
    return True


def get_current_vllm_config():
    return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}, static_all_moe_layers=[]))


ForwardContext = VllmConfig = FusedMoEConfig = FusedMoEMethodBase = RoutedExperts = FusedMoERouter = object
ExpertPlacementStrategy = EplbLayerState = MoEActivation = object


class UnfinalizedMoEOutput:
    pass


class ZeroExpertRouter:
    pass


class MoERunnerInterface(torch.nn.Module):
    pass


current_platform = SimpleNamespace(is_tpu=lambda: False, is_cpu=lambda: True, is_cuda_alike=lambda: False)
ALL_REDUCES = []


def tensor_model_parallel_all_reduce(x):
    ALL_REDUCES.append(tuple(x.shape))
    return x


def direct_register_custom_op(**kwargs):
    pass


def dispatch_unquantized_gemm():
    raise AssertionError("not stood in for")


get_ep_group = get_pcp_group = dispatch_unquantized_gemm
init_logger = logging.getLogger

'''

_SHARED_HEAD = '''"""Test tree: vLLM 0.33.0's shared_experts.py (from the wheel) over fakes of what it imports."""
import logging
from types import SimpleNamespace

import torch

envs = SimpleNamespace(VLLM_DISABLE_SHARED_EXPERTS_STREAM=False, VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD=256)
FusedMoEConfig = object
current_platform = SimpleNamespace(is_cuda_alike=lambda: False)


class _Logger(logging.Logger):
    def debug_once(self, *args):
        pass


def init_logger(name):
    return _Logger(name)


def get_current_vllm_config_or_none():
    return None


def aux_stream():
    return None


def current_stream():
    return torch.cuda.current_stream()


def dbo_current_ubatch_id():
    return 0

'''


def members() -> Path:
    """The small zip of the wheel's files: ``$ENV`` if set (it must exist), else the cached copy, else skip."""
    from helpers.wheels import cache_dir

    given = os.environ.get(ENV)
    if given:
        if not Path(given).is_file():
            pytest.fail(f"{ENV}={given} does not exist (.ci/run should have fetched it)")
        return Path(given)
    path = cache_dir() / MEMBERS_NAME
    if not path.is_file():
        pytest.skip(f"{MEMBERS_NAME} is not here: run .ci/run, or `python .ci/wheel_members.py vllm==0.33.0 {WHEEL} "
                    f"{path} {' '.join(FILES)}` (or set {ENV})")
    return path


def read(member: str) -> str:
    with zipfile.ZipFile(members()) as z:
        return z.read(member).decode("utf-8")


def _without_vllm_imports(text: str) -> str:
    """The module's text with its ``import vllm...`` / ``from vllm... import`` statements blanked (lines kept)."""
    lines = text.splitlines()
    for node in ast.parse(text).body:
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if any(n == "vllm" or n.startswith("vllm.") for n in names):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""
    return "\n".join(lines) + "\n"


def write_tree(root: Path, edit=None) -> Path:
    """The tree under ``root``; ``edit(member, text) -> text`` changes a file (a drifted copy)."""
    edit = edit or (lambda m, t: t)
    pkg = Path(RUNNER).parent
    for i in range(1, len(pkg.parts) + 1):
        d = root.joinpath(*pkg.parts[:i])
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    (root / "vllm" / "version.py").write_text('__version__ = "0.33.0"\n')
    (root / RUNNER).write_text(_RUNNER_HEAD + edit(RUNNER, _without_vllm_imports(read(RUNNER))))
    (root / SHARED).write_text(_SHARED_HEAD + edit(SHARED, _without_vllm_imports(read(SHARED))))
    ops = read(OPS)
    (root / OPS).write_text('"""Test tree: two functions of vLLM 0.33.0\'s _aiter_ops.py (from the wheel)."""\nimport torch\n\n\n'
                            + edit(OPS, "\n\n".join(server_tree.segment(ops, q) for q in OPS_FUNCTIONS)))
    return root


def importable(root: Path):
    return server_tree.importable(root, "vllm")


@pytest.fixture
def vllm_tree(tmp_path):
    root = write_tree(tmp_path / "tree")
    with importable(root):
        yield root
