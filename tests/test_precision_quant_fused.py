"""The fused (torch.compile'd) FP8 quantiser against the eager one, bit for bit: every operand layout the FP8
Linear quantises, odd shapes, E4M3's ties and saturation, zeros, denormals, inf and NaN; graphs reused
across shapes; one warning and the eager result when compiling fails; an FP8 training step equal to the bit
with the fused quantiser on and off.

Compiling is the cost here (seconds a graph on a CPU): the compiled functions live in precision/quant_fused.py
for the whole session, and the cases below keep to few graphs per kind (float32; x or x^T; sizes past one
tile, not multiples of it), so most tests reuse what an earlier one compiled.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import precision.quant_fused as qf
from helpers import model_config, precision_config
from model import Transformer
from precision import build_recipe
from precision.fp8_linear import Fp8Linear
from precision.quant import E4M3, QTensor, quantize
from precision.quant_fused import fused_status, quantize_fused

pytestmark = pytest.mark.usefixtures("one_thread")

R, C = 200, 300  # 1 full + 1 partial block of rows; 2 full + 1 partial tile (and block) of columns


def assert_same_bits(fused: QTensor, eager: QTensor) -> None:
    assert fused.data.dtype == E4M3 and fused.data.shape == eager.data.shape and fused.kind == eager.kind
    assert torch.equal(fused.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert fused.scale.dtype == eager.scale.dtype and fused.scale.shape == eager.scale.shape
    nan = eager.scale.isnan()
    assert torch.equal(fused.scale.isnan(), nan) and torch.equal(fused.scale[~nan], eager.scale[~nan])


def e4m3_ties() -> torch.Tensor:
    """Every midpoint between neighbouring positive E4M3 values (round-half-even decides), and the FP32
    numbers either side of it."""
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3).float()  # 0 … 448, 0x7F is NaN
    mid = (v[:-1] + v[1:]) / 2  # exact in FP32: E4M3 has 3 mantissa bits
    return torch.cat([mid, torch.nextafter(mid, torch.zeros(())), torch.nextafter(mid, torch.full((), 500.0))])


def edge_cases(seed: int = 0) -> torch.Tensor:
    """R×C in bands of 128 columns (a tile per row, a block per 128 rows):
        rows 0..127    zeros | FP32 denormals | just under the group's amax (x/s near 448, can overshoot)
        rows 128..199  E4M3 ties at s = 1 (amax 448) | near FP32 max | magnitudes 1e-6 … 1e6 per tile
    """
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (R, C), generator=g).float() * 2 - 1
    x = torch.randn(R, C, generator=g)
    x[:128, :128] = 0.0
    x[:128, 128:256] *= 1e-42
    a = 3.7
    x[:128, 256:] = a * (1 - torch.randint(0, 8, (128, C - 256), generator=g) * 2.0 ** -24) * sign[:128, 256:]
    x[:128, 256] = a
    ties = e4m3_ties()
    x[128:, :128] = ties[torch.randint(0, len(ties), (R - 128, 128), generator=g)] * sign[128:, :128]
    x[128:, 0] = 448.0
    x[128:, 128:256] = 3.0e38 * sign[128:, 128:256] * (1 - torch.rand(R - 128, 128, generator=g) * 1e-3)
    mags = 10.0 ** (torch.rand(R - 128, 1, generator=g) * 12 - 6)
    x[128:, 256:] *= mags
    return x


# The FP8 Linear's operands (precision/fp8_linear.py): (what, kind, transposed).
OPERANDS = [("forward x", "tile", False), ("forward w", "block", False), ("dgrad dy", "tile", False),
            ("wgrad dy^T", "tile", True), ("wgrad x^T", "tile", True),
            ("per-tensor x", "tensor", False), ("per-tensor x^T", "tensor", True)]


@pytest.mark.parametrize("what, kind, transposed", OPERANDS, ids=[o[0] for o in OPERANDS])
def test_fused_gives_the_eager_bits_for_every_operand_layout(what, kind, transposed):
    x = edge_cases(seed=len(what))
    x = x.t().contiguous().t() if transposed else x  # a (R, C) view of a C×R tensor: the backward's layout
    assert_same_bits(quantize_fused(x, kind), quantize(x, kind))
    if kind == "block":  # dgrad's W^T is the forward's blocks, transposed (no requantising)
        assert_same_bits(quantize_fused(x, kind).t(), quantize(x.t().contiguous(), kind))


@pytest.mark.parametrize("kind, transposed", [("tile", False), ("tile", True), ("block", False),
                                              ("tensor", False), ("tensor", True)])
def test_inf_and_nan_come_out_as_eager_has_them(kind, transposed):
    """A NaN poisons its group (scale NaN, every element NaN, E4M3 code and sign as eager's); an inf makes
    its group's scale inf, so the inf element is NaN (inf/inf) and the others 0."""
    x = torch.randn(R, C, generator=torch.Generator().manual_seed(1))
    x[3, 7], x[150, 140], x[40, 290], x[41, 5] = float("nan"), float("inf"), -float("inf"), -float("nan")
    x = x.t().contiguous().t() if transposed else x
    fused, eager = quantize_fused(x, kind), quantize(x, kind)
    assert_same_bits(fused, eager)
    assert eager.scale.isnan().any() and (eager.scale == float("inf")).any() == (kind != "tensor")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gives_the_eager_bits_on_cuda(dtype):
    """Triton's side (written without a GPU): every operand layout, the edge cases, inf and NaN; bf16 is what
    an FP8 recipe with autocast_dtype=bfloat16 hands the quantiser."""
    for what, kind, transposed in OPERANDS:
        x = edge_cases(seed=len(what)).to("cuda", dtype)
        x[3, 7], x[150, 140] = float("nan"), float("inf")
        x = x.t().contiguous().t() if transposed else x
        assert_same_bits(quantize_fused(x, kind), quantize(x, kind))
    assert all(v.startswith("compiled") for k, v in fused_status().items() if k.endswith("cuda")), fused_status()


def test_odd_shapes_reuse_the_compiled_graphs():
    """Sizes are symbols: after one shape of a class (float32, x or x^T, past one tile, not a multiple of
    it), every other shape of it runs the same graph."""
    g = torch.Generator().manual_seed(2)
    for kind in ("tile", "block"):
        quantize_fused(torch.randn(R, C), kind)
        before = counters["stats"]["unique_graphs"]
        for _ in range(6):
            r, c = (int(n) for n in torch.randint(129, 700, (2,), generator=g))
            r, c = r + (r % 128 == 0), c + (c % 128 == 0)
            x = torch.randn(r, c, generator=g)
            assert_same_bits(quantize_fused(x, kind), quantize(x, kind))
        assert counters["stats"]["unique_graphs"] == before, f"{kind}: recompiled for a new size"
    assert all(v.startswith("compiled") for v in fused_status().values()), fused_status()


def test_inside_a_compiled_model_it_is_the_model_graphs_own_ops():
    """Under an outer torch.compile (train.compile with an FP8 recipe) the quantiser's ops are traced into
    that graph, with no graph break and no nested compile (backend "eager": dynamo's trace alone)."""
    x = edge_cases()
    x[5, 9] = float("nan")
    traced = torch.compile(lambda t: tuple(quantize_fused(t, "tile"))[:2], backend="eager", fullgraph=True)
    assert_same_bits(QTensor(*traced(x), "tile"), quantize(x, "tile"))


def test_bad_input_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^quantize_fused: kind='row', expected one of tile, block, tensor$"):
        quantize_fused(torch.randn(4, 4), "row")
    with pytest.raises(ValueError, match=r"^quantize_fused: expected a 2-D tensor, got shape \(2, 3, 4\)$"):
        quantize_fused(torch.randn(2, 3, 4), "tile")


@pytest.fixture
def fresh_state(monkeypatch):
    """An empty compile cache for this test (the session's compiled functions stay untouched)."""
    monkeypatch.setattr(qf, "_STATE", {})
    monkeypatch.setattr(qf, "_CHECKED", set())


def test_a_failed_compile_says_so_once_and_runs_eager(fresh_state, monkeypatch):
    def broken(x, qmax):
        raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(qf, "_compile", lambda key: qf._STATE.setdefault(key, broken))
    x = torch.randn(R, C)
    with pytest.warns(RuntimeWarning, match=r"compiled tile quantiser .* eagerly .* InvalidCxxCompiler") as w:
        first = quantize_fused(x, "tile")
        second = quantize_fused(x, "tile")
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert_same_bits(first, quantize(x, "tile")) and assert_same_bits(second, quantize(x, "tile"))
    assert fused_status()["tile/128/cpu"].startswith("eager: torch.compile failed (TorchDynamoException")


def test_no_dynamo_here_says_so_once_and_runs_eager(fresh_state, monkeypatch):
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    x = torch.randn(R, C)
    with pytest.warns(RuntimeWarning, match=r"is_dynamo_supported\(\) is false") as w:
        assert_same_bits(quantize_fused(x, "tensor"), quantize(x, "tensor"))
        assert_same_bits(quantize_fused(x, "tensor"), quantize(x, "tensor"))
    assert len(w) == 1


def test_a_compiled_result_that_differs_from_eager_is_refused(fresh_state, monkeypatch):
    def off_by_one_ulp(x, qmax):
        data, scale = qf.GROUPINGS["block"](x, 128, qmax)
        return data, torch.nextafter(scale, torch.full_like(scale, math.inf))

    monkeypatch.setattr(qf, "_compile", lambda key: qf._STATE.setdefault(key, off_by_one_ulp))
    x = torch.randn(R, C)
    with pytest.warns(RuntimeWarning, match=r"on shape \(200, 300\) differs from precision/quant.py's"):
        assert_same_bits(quantize_fused(x, "block"), quantize(x, "block"))
    assert fused_status()["block/128/cpu"].startswith("eager:")


def test_fused_quant_is_on_for_cuda_only_unless_set():
    assert build_recipe(precision_config({"name": "fp8_block"}), "cpu").fused is False
    assert build_recipe(precision_config({"name": "fp8_block"}), "cuda").fused is True
    assert build_recipe(precision_config({"name": "fp8_tensor", "fused_quant": True}), "cpu").fused is True
    assert build_recipe(precision_config({"name": "fp8_block", "fused_quant": False}), "cuda").fused is False
    recipe = build_recipe(precision_config({"name": "fp8_block", "fused_quant": True}))
    assert any("quantiser: fused" in n and "precision.fused_quant=true" in n for n in recipe.table().notes)


def tiny_fp8(fused: bool, name: str):
    """Dense, every FP8 dim past one tile and not a multiple of it (d 144, qkv 432, MLP 400, 160 tokens)."""
    torch.manual_seed(0)
    model = Transformer(model_config({"vocab_size": 64, "seq_len": 16, "d_model": 144, "n_layers": 2,
                                      "n_heads": 2, "mlp_hidden": 400}))
    build_recipe(precision_config({"name": name, "fused_quant": fused})).convert(model)
    assert all(m.fused is fused for m in model.modules() if isinstance(m, Fp8Linear))
    return model


@pytest.mark.parametrize("name", ["fp8_block", "fp8_tensor"])
def test_an_fp8_training_step_is_bit_equal_fused_or_not(name):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (10, 16), generator=g)
    targets = torch.randint(0, 64, (10, 16), generator=g)
    runs = []
    for fused in (False, True):
        model = tiny_fp8(fused, name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):  # the second step's loss comes from the first step's update
            out = model(tokens, targets)
            out.loss_sum.backward()
            losses.append(out.loss_sum.detach())
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((losses, grads, [p.detach().clone() for p in model.parameters()]))
    (l0, g0, p0), (l1, g1, p1) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and math.isfinite(l0[1].item())
    assert all(torch.equal(a, b) for a, b in zip(g0, g1)) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert not torch.equal(l0[0], l0[1])  # the step moved the weights
    assert all(v.startswith("compiled") for v in fused_status().values())


@pytest.mark.slow  # four cold compiles
def test_a_torch_without_per_call_limits_raises_the_global_one_while_compiling(fresh_state, monkeypatch):
    """torch < 2.13 shares dynamo's global recompile limit (8) between the kinds, dtypes and layouts: on torch 2.11
    on a GPU the tensor kind went eager past it. There the limit is raised while a fused call compiles: held here
    on this torch with the per-call keywords taken away and the global limit at 2, below the 4 graphs compiled."""
    monkeypatch.setattr(qf, "_COMPILE_KW", {})
    monkeypatch.setattr(qf, "_GLOBAL_LIMIT", {"recompile_limit": qf.RECOMPILE_LIMIT})
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    torch._dynamo.reset()  # NOTE: the cache of the closure's code is shared with earlier tests' compiles
    for dtype in (torch.float32, torch.bfloat16):
        for transposed in (False, True):
            x = torch.randn(R, C, generator=torch.Generator().manual_seed(2)).to(dtype)
            x = x.t().contiguous().t() if transposed else x
            assert_same_bits(quantize_fused(x, "tensor"), quantize(x, "tensor"))
    assert fused_status()["tensor/128/cpu"].startswith("compiled"), fused_status()
