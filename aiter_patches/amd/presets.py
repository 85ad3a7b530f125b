"""Model shapes the patches target, and the ``--shapes`` parser.

Why: what the kernels compile to depends on a model's MoE routing shape (experts, topk),
its hidden size, and what the server varies call by call (token count, AITER's block size)
or fixes at start-up (quant dtype, expert parallelism, ``num_local_tokens``, how the stage-2
output buffer is prepared). A preset names the first group and the ranges of the second.

Sources of the numbers (README "Compiling for AMD without an AMD GPU" repeats them):
AITER's tuned MoE configs at the pinned commit e4048607a5 (``aiter/configs/model_configs/``:
``dsv3_fp4_tuned_fmoe.csv`` 256 experts/topk 8/model_dim 7168 and 257/9 with the shared
expert fused; ``qwen3_235b_bf16_tuned_fmoe.csv`` 128/8/4096; ``minimax_m3_*_tuned_fmoe.csv``
129/5/6144 with the shared expert fused, i.e. 128/4 routed; ``kimik3_*_tuned_fmoe.csv``
896/16/3584), which agree with the values in issue 13. Block sizes 32/64/128 are those
AITER's tuned MX configs choose across token counts; 16 is the per-1x128 choice at small
token counts (sort only). Token counts to 32768, the largest AITER tunes for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

QUANTS = ("none", "fp4", "fp8")  # stage-1 activations: not quantized here, MXFP4, MXFP8
EP_MODES = ("off", "on", "on+nlt")  # expert_mask, and num_local_tokens with it
BUF_MODES = ("zero", "keep", "addend")  # moe_buf zeroed / left (accumulate=False) / set to the shared addend


@dataclass(frozen=True)
class ModelShape:
    name: str
    routing: tuple[tuple[int, int], ...]  # (experts, topk) pairs the server may run
    hidden: int
    shared_experts: int = 0  # > 0: the addend fold writes moe_buf from the shared expert's output
    max_tokens: int = 32768
    quants: tuple[str, ...] = QUANTS
    ep_modes: tuple[str, ...] = EP_MODES
    buf_modes: tuple[str, ...] = BUF_MODES
    block_sizes: tuple[int, ...] = ()  # () = AITER's choices (see ``blocks_for``)

    def blocks_for(self, quant: str) -> tuple[int, ...]:
        if self.block_sizes:
            return self.block_sizes
        return (16, 32, 64, 128) if quant == "none" else (32, 64, 128)

    def buf_modes_for(self, ep: str) -> tuple[str, ...]:
        """AITER zeroes moe_buf whenever an expert mask is given; the addend needs a shared expert."""
        modes = tuple(m for m in self.buf_modes if m != "addend" or self.shared_experts)
        return tuple(m for m in modes if m != "keep" or ep == "off")


PRESETS: dict[str, ModelShape] = {
    p.name: p
    for p in (
        ModelShape("DeepSeek-V3", routing=((256, 8), (257, 9)), hidden=7168, shared_experts=1),
        ModelShape("Qwen3-235B-A22B", routing=((128, 8),), hidden=4096),
        ModelShape("MiniMax-M3", routing=((128, 4), (129, 5)), hidden=6144, shared_experts=1),
        ModelShape("Kimi-K3", routing=((896, 16),), hidden=3584, shared_experts=1),
    )
}
ALIASES = {"deepseek-r1": "DeepSeek-V3", "deepseek-v3": "DeepSeek-V3", "deepseek": "DeepSeek-V3",
           "qwen3-235b": "Qwen3-235B-A22B", "qwen3-235b-a22b": "Qwen3-235B-A22B",
           "minimax-m3": "MiniMax-M3", "kimi-k3": "Kimi-K3"}


def preset(name: str) -> ModelShape:
    key = ALIASES.get(name.lower(), name)
    if key not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]


SHAPE_BLOCKS = (16, 32, 64, 128)  # AITER's MoE block sizes: the only ones the sort kernel takes
_SHAPE_KEYS = ("experts", "topk", "hidden", "tokens", "blocks", "quant", "ep", "buf", "shared", "name")


def parse_shapes(text: str) -> ModelShape:
    """``experts=E,topk=K,hidden=H[,tokens=N][,blocks=32/64][,quant=fp4/fp8/none][,ep=off/on/on+nlt]
    [,buf=zero/keep/addend][,shared=1]`` (lists separated by ``/``).

    Every field is checked against its rule (``ValueError`` names the field, its value and the
    rule): experts >= 1; topk >= 1 and at most its experts; hidden, tokens >= 1, tokens below
    2**24 (the sort's 24-bit token field); blocks in 16/32/64/128; shared >= 0; each key once."""
    from ..aiter_contract import TOKEN_BITS

    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value.strip():
            raise ValueError(f"--shapes: {part!r} is not key=value")
        key = key.strip().lower()
        if key in fields:
            raise ValueError(f"--shapes: {key} given twice")
        fields[key] = value.strip()
    unknown = set(fields) - set(_SHAPE_KEYS)
    if unknown:
        raise ValueError(f"--shapes: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(_SHAPE_KEYS))}")
    missing = {"experts", "topk", "hidden"} - set(fields)
    if missing:
        raise ValueError(f"--shapes needs {', '.join(sorted(missing))}")

    def ints(key: str, rule: str, ok, one: bool = False) -> tuple[int, ...]:
        """The integers of `key` (one when `one`), each `ok(v)`; else ValueError naming the field and `rule`."""
        try:
            vals = tuple(int(v) for v in fields[key].split("/"))
        except ValueError:
            raise ValueError(f"--shapes: {key}={fields[key]!r} is not an integer{'' if one else ' list'} "
                             f"({rule})") from None
        if one and len(vals) != 1:
            raise ValueError(f"--shapes: {key}={fields[key]} takes one value ({rule})")
        bad = [v for v in vals if not ok(v)]
        if bad:
            raise ValueError(f"--shapes: {key}={'/'.join(map(str, bad))}: {rule}")
        return vals

    def words(key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        vals = tuple(fields[key].split("/"))
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise ValueError(f"--shapes: {key}={'/'.join(bad)} not in {'/'.join(allowed)}")
        return vals

    experts = ints("experts", "each experts must be an integer >= 1", lambda v: v >= 1)
    topk = ints("topk", "each topk must be an integer >= 1", lambda v: v >= 1)
    hidden = ints("hidden", "hidden must be an integer >= 1", lambda v: v >= 1, one=True)
    if len(experts) != len(topk):
        raise ValueError("--shapes: experts and topk take lists of equal length")
    over = [f"{k} > {e}" for e, k in zip(experts, topk) if k > e]
    if over:
        raise ValueError(f"--shapes: topk {', '.join(over)} experts (each topk at most its experts)")
    shared = 0
    if "shared" in fields:
        shared = ints("shared", "shared must be an integer >= 0", lambda v: v >= 0, one=True)[0]
    shape = ModelShape(fields.get("name", "custom"), routing=tuple(zip(experts, topk)), hidden=hidden[0],
                       shared_experts=shared)
    if "tokens" in fields:
        limit = (1 << TOKEN_BITS) - 1
        tokens = ints("tokens", f"tokens must be an integer in 1..{limit}", lambda v: 1 <= v <= limit, one=True)
        shape = replace(shape, max_tokens=tokens[0])
    if "blocks" in fields:
        rule = f"each block must be one of {'/'.join(map(str, SHAPE_BLOCKS))}"
        shape = replace(shape, block_sizes=ints("blocks", rule, lambda v: v in SHAPE_BLOCKS))
    if "quant" in fields:
        shape = replace(shape, quants=words("quant", QUANTS))
    if "ep" in fields:
        shape = replace(shape, ep_modes=words("ep", EP_MODES))
    if "buf" in fields:
        shape = replace(shape, buf_modes=words("buf", BUF_MODES))
    return shape


def token_counts(max_tokens: int, topk: int = 1) -> list[int]:
    """Token counts that meet every class a launch can tell apart by powers of two and ``% 16``.

    The launchers derive their constexprs from the token count ``M`` and the pair count
    ``M * topk`` through powers of two, and Triton specializes integer arguments on ``== 1``
    and ``% 16 == 0``. So: both ends of every interval between the boundaries where ``M`` or
    ``M * topk`` reaches or passes a power of two, and in each interval one multiple of 16 and
    one other count.
    """
    bounds = {1, max_tokens + 1}
    j = 0
    while 2**j <= max_tokens * max(topk, 1):
        for b in (2**j, 2**j + 1, -(-(2**j) // topk), 2**j // topk + 1):  # M >= 2^j, M > 2^j, M*K >= 2^j, M*K > 2^j
            if 1 <= b <= max_tokens + 1:
                bounds.add(b)
        j += 1
    edges = sorted(bounds)
    ms = set()
    for lo, hi in zip(edges, edges[1:]):  # the interval [lo, hi)
        ms.update({lo, hi - 1})
        sixteen = -(-lo // 16) * 16
        if sixteen < hi:
            ms.add(sixteen)
        other = next((m for m in range(lo, min(hi, lo + 17)) if m % 16), None)
        if other is not None:
            ms.add(other)
    return sorted(m for m in ms if 1 <= m <= max_tokens)
