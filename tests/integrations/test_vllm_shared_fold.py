"""``vllm_shared_expert_fold`` on vLLM 0.33.0's own MoERunner and SharedExperts (from the wheel) and the stand-in AITER.

The runner is vLLM's class with the attributes its code reads; its routed experts
run vLLM's own ``_rocm_aiter_fused_moe_impl`` (from the wheel's _aiter_ops.py), which calls
the stand-in's ``aiter.fused_moe.fused_moe``, and copy the result into their output as
``AiterExperts.apply`` does. Checked: within the fold's bound of vLLM's own sum, the
add gone (counted aten adds), every path that must not fold run bitwise as shipped
with its reason, the op called without ``forward`` (a compiled graph) counted,
torch.compile tracing vLLM's add, a drifted copy skipped, revert.
"""

import importlib
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import aiter_patches
from aiter_patches.checks import bf16_moe_inputs
from aiter_patches.verify import suspended

from .vllm_tree import importable, vllm_tree, write_tree  # noqa: F401  (fixture)

NAME = "vllm_shared_expert_fold"
RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
SHARED = "vllm.model_executor.layers.fused_moe.runner.shared_experts"
M, DIM = 6, 256


class FakeRouter:
    def __init__(self, args):
        self.args = args

    def select_experts(self, hidden_states, router_logits, topk_indices_dtype=None, input_ids=None):
        return self.args["topk_weight"], self.args["topk_ids"]


def vllm_fused_moe_impl():
    """vLLM 0.33.0's ``_rocm_aiter_fused_moe_impl`` (the body of ``torch.ops.vllm.rocm_aiter_fused_moe``), from its
    _aiter_ops.py, with the shared-expert argument check it calls; it imports AITER's fused_moe at call time."""
    import ast

    from .vllm_tree import read

    text = read("vllm/_aiter_ops.py")
    wanted = ("_validate_rocm_aiter_fused_moe_shared_expert_args", "_rocm_aiter_fused_moe_impl")
    nodes = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    ns = {"torch": torch, "rocm_aiter_ops": types.SimpleNamespace(fused_moe_supports_gate_mode=lambda: False)}
    exec(compile(ast.Module(nodes, []), "vllm/_aiter_ops.py", "exec"), ns)
    return ns["_rocm_aiter_fused_moe_impl"]


class FakeRoutedExperts:
    """vLLM's modular AITER path, reduced to what reaches AITER: vLLM's own op body, then the MK output's copy."""

    def __init__(self, args, reduced=False):
        self.args = args
        self.impl = vllm_fused_moe_impl()
        self.quant_method = types.SimpleNamespace(
            is_monolithic=False, topk_indices_dtype=None, supports_internal_mk=False, skip_forward_padding=False,
            has_unpadded_output=False, mk_can_overlap_shared_experts=False,
            moe_kernel=types.SimpleNamespace(output_is_reduced=lambda: True) if reduced else None)

    def _ensure_moe_quant_config_init(self):
        pass

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        a = self.args  # as rocm_aiter_fused_experts passes them for bf16 weights (QuantMethod.NO, SiLU)
        result = self.impl(x, a["w1"], a["w2"], topk_weights.to(torch.float32), topk_ids.to(torch.int32),
                           output_dtype=x.dtype)
        output = torch.empty_like(x)  # AiterExperts.apply: the modular kernel's output buffer
        output.copy_(result)
        return output


class FakeSharedMLP:
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x @ self.w


def parallel(**kw):
    cfg = dict(use_all2all_kernels=False, enable_eplb=False, all2all_backend="", use_fi_nvl_two_sided_kernels=False)
    cfg.update(kw)
    return types.SimpleNamespace(**cfg)


def make_runner(device, cls=None, parallel_config=None, reduced=False, **overrides):
    mr, se = sys.modules[RUNNER], sys.modules[SHARED]
    args = bf16_moe_inputs(device, M=M, E=8, topk=2, dim=DIM, inter=128, seed=7)
    w = (torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(9)) / 16).to(torch.bfloat16).to(device)
    moe_config = types.SimpleNamespace(
        hidden_dim=DIM, dp_size=1, is_sequence_parallel=False, pcp_size=1, tp_size=1, ep_size=1, sp_size=1,
        use_ep=False, skip_final_all_reduce=False, hidden_dim_unpadded=DIM,
        moe_parallel_config=parallel_config or parallel())
    runner = (cls or mr.MoERunner).__new__(cls or mr.MoERunner)
    torch.nn.Module.__init__(runner)
    shared = se.SharedExperts(FakeSharedMLP(w), moe_config, enable_dbo=False,
                              mk_can_overlap_shared_experts=lambda: runner._quant_method.mk_can_overlap_shared_experts)
    attrs = dict(moe_config=moe_config, router=FakeRouter(args), routed_input_transform=None,
                 routed_output_transform=None, routed_scaling_factor=1.0, gate=None, shared_expert_gate=None,
                 routed_experts=FakeRoutedExperts(args, reduced), enable_dbo=False, _fse_fuse_gate=False,
                 _combined_gate_weight=None, _shared_experts=shared, layer_name="model.layers.3.mlp.experts")
    attrs.update(overrides)
    for k, v in attrs.items():
        setattr(runner, k, v)
    runner._forward_entry = runner._select_forward()  # on CPU: vLLM's _moe_forward_shared, the op's own body
    mr.FORWARD_CONTEXT.no_compile_layers[runner.layer_name] = runner
    return runner, args["hidden_states"]


class AddCounter(TorchDispatchMode):
    """Counts aten add/add_ calls whose output is ``[M, DIM]`` (the shared-expert add, and the stand-in's stage 2)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and \
                tuple(getattr(out, "shape", ())) == (M, DIM):
            self.count += 1
        return out


def import_all(stub):
    importlib.import_module(RUNNER)
    importlib.import_module("aiter.fused_moe")


def bits(t):
    return t.view(torch.int16)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("AITER_PATCHES_INTEGRATIONS", "vllm")


def test_off_by_default(vllm_tree, stub):
    import_all(stub)
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "disabled" and "AITER_PATCHES_INTEGRATIONS=vllm" in report[NAME]["reason"]


def test_fold_within_bound_and_the_add_is_gone(vllm_tree, stub, device, on):
    import_all(stub)
    runner, x = make_runner(device)
    with suspended():
        with AddCounter() as c0:
            ref = runner.forward(x, x)
        with AddCounter() as c_moe:
            runner.routed_experts.forward_modular(x, *runner.router.select_experts(x, x))
    assert c0.count == c_moe.count + 1  # the MoE's own adds, and vLLM's `shared_output + fused_output`
    report = aiter_patches.apply()
    assert report[NAME]["state"] == "applied", report[NAME]["reason"]
    with AddCounter() as c1:
        out = runner.forward(x, x)
    assert c1.count == c_moe.count  # vLLM's add is gone: stage 2 accumulated onto the shared output
    assert rel(out, ref) <= 1e-2
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 1 and s[NAME]["fallback"] == {}
    assert s["moe_addend_fold"]["fast"] == 1
    assert runner._shared_experts._output == [None, None]  # vLLM's slot was consumed as shipped


def _subclass():
    return type("MuseMoERunner", (sys.modules[RUNNER].MoERunner,), {})


@pytest.mark.parametrize("case, reason", [
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor is applied"),
    (dict(parallel_config=parallel(use_all2all_kernels=True)), "expert/data/context/sequence parallel"),
    (dict(reduced=True), "the combine kernel reduces the routed output"),
    ("subclass", "MuseMoERunner: a subclass of MoERunner"),
    (dict(_shared_experts=None), "no separate shared experts"),  # e.g. AITER's fused shared expert
    (dict(routed_output_transform=lambda t: t), "latent MoE"),
])
def test_paths_that_must_not_fold_run_as_shipped(vllm_tree, stub, device, on, case, reason):
    import_all(stub)
    kw = dict(cls=_subclass()) if case == "subclass" else case
    runner, x = make_runner(device, **kw)
    with suspended():
        ref = runner.forward(x, x)
    aiter_patches.apply()
    out = runner.forward(x, x)
    assert torch.equal(bits(out), bits(ref))
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and list(s["fallback"]) == [k for k in s["fallback"] if reason in k] != [], s


def test_the_aux_stream_order_is_left_alone_and_counted(vllm_tree, stub, device, on, monkeypatch):
    """At <= 256 tokens on ROCm/CUDA vLLM enqueues the shared experts on its aux stream before the router: emulated
    here by vLLM's own order decision forced to MULTI_STREAM_OVERLAPPED and a synchronous stand-in of the launch."""
    from aiter_patches.integrations import vllm_shared_fold as fold

    import_all(stub)
    se = sys.modules[SHARED]
    runner, x = make_runner(device)
    shared = runner._shared_experts

    def launch(inp):
        if shared._determine_shared_experts_order(inp) != se.SharedExpertsOrder.MULTI_STREAM_OVERLAPPED:
            return False
        shared._output[0] = shared._layer(inp)
        return True

    monkeypatch.setattr(shared, "_stream", object())  # an aux stream exists
    monkeypatch.setattr(se.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(shared, "maybe_forward_async", launch)
    monkeypatch.setattr(shared, "wait", lambda: None)
    with suspended():
        ref = runner.forward(x, x)
    aiter_patches.apply()
    out = runner.forward(x, x)
    assert torch.equal(bits(out), bits(ref))
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.AUX_STREAM: 1}


def test_the_op_without_forward_is_counted(vllm_tree, stub, device, on):
    """A compiled graph calls the opaque op alone: the add is in the graph, so nothing folds and the reason is counted."""
    from aiter_patches.integrations import vllm_shared_fold as fold

    import_all(stub)
    runner, x = make_runner(device)
    with suspended():
        ref = runner._forward_entry(x, x, x, None, runner.layer_name, 0)
    aiter_patches.apply()
    got = runner._forward_entry(x, x, x, None, runner.layer_name, 0)
    assert all(torch.equal(bits(g), bits(r)) for g, r in zip(got, ref))
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.NO_SCOPE: 1}
    assert aiter_patches.stats()["moe_addend_fold"]["fast"] == 0


def test_torch_compile_traces_vllms_add(vllm_tree, stub, device, on):
    """Dynamo traces forward (our hooks take vLLM's path under is_compiling) around an opaque op, as vLLM compiles it:
    the compiled result is vLLM's sum bitwise, the graph holds the add, and the op's run-time call is counted."""
    from aiter_patches.integrations import vllm_shared_fold as fold

    import_all(stub)
    runner, x = make_runner(device)
    mr = sys.modules[RUNNER]
    with suspended():
        ref = runner.forward(x, x)

    @torch.library.custom_op("aptest_vllm::moe_forward_shared", mutates_args=())
    def op(hidden_states: torch.Tensor, router_logits: torch.Tensor, shared_experts_input: torch.Tensor,
           layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        s, f = mr._moe_forward_shared(hidden_states, router_logits, shared_experts_input, None, layer_name, 0)
        return s.clone(), f.clone()

    @op.register_fake
    def _(hidden_states, router_logits, shared_experts_input, layer_name):
        return torch.empty_like(hidden_states), torch.empty_like(hidden_states)

    runner._forward_entry = lambda hs, logits, sei, ids, name, unpadded: op(hs, logits, sei, name)
    aiter_patches.apply()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(runner.forward, backend=backend, fullgraph=True)
    out = compiled(x, x)
    assert torch.equal(bits(out), bits(ref))
    code = graphs[0].code
    assert "aptest_vllm.moe_forward_shared" in code and ("add" in code or "+" in code)
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.NO_SCOPE: 1} and aiter_patches.stats()[NAME]["fast"] == 0


def test_a_routed_call_that_skips_fused_moe_is_counted(vllm_tree, stub, device, on, monkeypatch):
    from aiter_patches.integrations import vllm_shared_fold as fold

    import_all(stub)
    runner, x = make_runner(device)
    with suspended():
        ref = runner.forward(x, x)
        routed = runner.routed_experts.forward_modular(x, *runner.router.select_experts(x, x))
    aiter_patches.apply()
    monkeypatch.setattr(runner.routed_experts, "forward_modular", lambda *a, **k: routed.clone())  # a Triton path
    out = runner.forward(x, x)
    assert torch.equal(bits(out), bits(ref))
    assert aiter_patches.stats()[NAME]["fallback"] == {fold.NOT_REACHED: 1}


def test_a_drifted_copy_is_skipped(tmp_path, stub, on):
    from .vllm_tree import RUNNER as RUNNER_FILE

    def edit(member, text):
        if member == RUNNER_FILE:
            return text.replace("result = shared_output + fused_output", "result = fused_output + shared_output", 1)
        return text

    with importable(write_tree(tmp_path / "drifted", edit)):
        import_all(stub)
        report = aiter_patches.apply()
        assert report[NAME]["state"] == "skipped"
        assert "MoERunner.forward: source changed" in report[NAME]["reason"]
        cls = sys.modules[RUNNER].MoERunner
        assert all(getattr(getattr(cls, m), "__aiter_patches__", None) is None
                   for m in ("forward", "_forward_impl", "_maybe_apply_routed_scale_to_output"))


def test_revert_restores_the_methods(vllm_tree, stub, on):
    import_all(stub)
    mr, se = sys.modules[RUNNER], sys.modules[SHARED]
    names = ("forward", "_forward_impl", "_maybe_apply_routed_scale_to_output")
    before = [getattr(mr.MoERunner, n) for n in names] + [se.SharedExperts.forward]
    aiter_patches.apply()
    assert mr.MoERunner.forward is not before[0] and se.SharedExperts.forward is not before[3]
    aiter_patches.revert()
    assert [getattr(mr.MoERunner, n) for n in names] + [se.SharedExperts.forward] == before


def test_inside_a_compiled_region_nothing_is_folded(vllm_tree, stub, device, on, monkeypatch):
    """Eager here but inside a torch.compile'd caller: Dynamo could trace the scale hook while the op runs eagerly."""
    from aiter_patches.integrations import compile_state

    import_all(stub)
    runner, x = make_runner(device)
    with suspended():
        ref = runner.forward(x, x)
    aiter_patches.apply()
    monkeypatch.setattr(compile_state, "in_compiled_region", lambda: True)
    out = runner.forward(x, x)
    assert torch.equal(bits(out), bits(ref))
    s = aiter_patches.stats()
    assert s[NAME]["fast"] == 0 and s[NAME]["fallback"] == {compile_state.IN_COMPILED_REGION: 1}, s[NAME]
    assert s["moe_addend_fold"]["fast"] == 0


def test_a_call_short_of_an_argument_gets_pythons_type_error(vllm_tree, stub, device, on):
    """Not the hook's KeyError: the call goes to vLLM's method as given, counted with the binder's reason."""
    import_all(stub)
    runner, x = make_runner(device)
    aiter_patches.apply()
    with pytest.raises(TypeError):
        runner.forward(x)
    s = aiter_patches.stats()[NAME]
    assert s["fast"] == 0 and [r for r in s["fallback"] if r.startswith("required argument not given: ")], s
