"""The FP8 quantiser fused: per kind, precision/quant.py's amax, scale and cast as one torch.compile'd
function (Inductor: C++ loops on a CPU, Triton kernels on a GPU).

    q = quantize_fused(x, kind, tile)   # the QTensor quantize(x, kind, tile) returns, bit for bit

Eager, a quantisation runs one kernel per op (pad, abs, amax, clamp, divide, clamp, cast), each a pass
over memory; compiled, the same ops read x twice (the amax, then divide-clamp-cast) and write q once. That
pays where the passes are the cost, a GPU; on a CPU Inductor's E4M3 cast is slower than eager's, and
precision.fused_quant (precision/config.py) leaves it off there. What is compiled is quant.py's GROUPINGS
themselves: the math is declared once, and the eager `quantize` stays the readable reference.

Compiled lazily, once per (kind, tile, device type), with x's sizes as symbols, so a new shape reuses the
graph. What still recompiles is a finite set of guards (x's dtype; x or x^T layout; a size of 1 or a
single group; a size a multiple of the tile or not), bounded per function by RECOMPILE_LIMIT.

The same operations in the same order give the same bits (a max is exact in any order), but for three
compiler behaviours, all kept out:
  - off the CPU, Inductor turns x / constant into x · (1/constant); 1/448 is inexact, so the quotient
    would round differently: 448 comes in as a tensor (qmax), not a constant;
  - Triton's x / y is approximate: eager_numerics.division_rounding asks for IEEE division;
  - Inductor's CPU max and min set a NaN's sign bit: quant.py puts eager's NaN back under compile.
The first result of each (kind, tile, device type) is checked bit for bit against the eager quantiser; a
mismatch, or a failure to compile, switches that one to the eager quantiser for the rest of the process, with
one warning. `fused_status()` says which. On an H200 (torch 2.11) that check found eager's own scale one ulp
off (CUDA divides by a number through its reciprocal: quant.py now divides by qmax_on's tensor) and the
shared recompile limit passed (_GLOBAL_LIMIT below).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable

import torch

from precision.quant import GROUPINGS, TILE, QTensor, check_input, qmax_on

# NOTE: generous on purpose: the guards are a finite set (above) and a function past its limit goes eager
# with a warning, so the limit only has to sit above what one run's operands reach.
RECOMPILE_LIMIT = 64
_OPTIONS = {"eager_numerics.division_rounding": True}
# NOTE: torch >= 2.13 gives each torch.compile call its own cache and limit; an older one shares the global
# recompile_limit between the kinds (all compile the closure below), and past it dynamo runs eagerly itself.
_PER_CALL = {"recompile_limit": RECOMPILE_LIMIT, "isolate_recompiles": True}
_COMPILE_KW = {k: v for k, v in _PER_CALL.items() if k in inspect.signature(torch.compile).parameters}
# NOTE: without them (torch < 2.13), the global limit (8 by default) is raised while a fused call compiles: the kinds
# and an operand's dtypes and layouts would otherwise pass it together (seen on torch 2.11 on a GPU)
_GLOBAL_LIMIT = ({} if "recompile_limit" in _COMPILE_KW or not hasattr(torch._dynamo.config, "recompile_limit")
                 else {"recompile_limit": RECOMPILE_LIMIT})

Key = tuple[str, int, str]  # (kind, tile, device type)
_STATE: dict[Key, Callable | str] = {}  # the compiled function, or why this key runs eagerly
_CHECKED: set[Key] = set()             # keys whose first compiled result matched the eager one


def quantize_fused(x: torch.Tensor, kind: str, tile: int = TILE) -> QTensor:
    """quantize(x, kind, tile), compiled. No autograd graph: the quantiser is never differentiated (the
    FP8 Linear defines its own backward), and one grad mode is one guard fewer."""
    check_input(x, kind, "quantize_fused")
    if torch.compiler.is_compiling():  # inside a compiled model: its graph compiles these ops with the rest
        return _eager(x, kind, tile)
    key = (kind, tile, x.device.type)
    fn = _STATE[key] if key in _STATE else _compile(key)
    if isinstance(fn, str):
        return _eager(x, kind, tile)
    # NOTE: detached, x is a plain tensor that is no view and needs no grad, whatever it was: a Parameter
    # gets static shapes (one graph per weight shape), and requires_grad and a view's base are guarded.
    # Its sizes are symbols from the first compile on (automatic dynamic would wait for a recompile);
    # tile stays a constant (dynamic=True would make it a symbol too).
    x_in = x.detach()
    torch._dynamo.maybe_mark_dynamic(x_in, (0, 1))
    try:
        limit = torch._dynamo.config.patch(**_GLOBAL_LIMIT) if _GLOBAL_LIMIT else contextlib.nullcontext()
        with torch.no_grad(), limit:
            data, scale = fn(x_in, qmax_on(x.device))
    except torch.OutOfMemoryError:
        raise
    except _compile_errors() as e:
        _go_eager(key, f"torch.compile failed ({type(e).__name__}: {_first_line(e)})")
        return _eager(x, kind, tile)
    if key not in _CHECKED:
        ref = _eager(x, kind, tile)
        if not same_bits(QTensor(data, scale, kind, tile), ref):
            _go_eager(key, f"its result on shape {tuple(x.shape)} differs from precision/quant.py's")
            return ref
        _CHECKED.add(key)
    return QTensor(data, scale, kind, tile)


def same_bits(a: QTensor, b: QTensor) -> bool:
    """Equal E4M3 bit patterns and scales (NaN where the other has NaN: a poisoned group stays poisoned)."""
    return (a.data.shape == b.data.shape and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
            and a.scale.shape == b.scale.shape and a.scale.dtype == b.scale.dtype
            and bool(((a.scale == b.scale) | (a.scale.isnan() & b.scale.isnan())).all()))


def fused_status() -> dict[str, str]:
    """'kind/tile/device' -> how it runs: compiled (checked against eager, or not called yet) or eager, why."""
    return {"/".join(map(str, k)): (f"eager: {v}" if isinstance(v, str) else
                                    "compiled, first result bit-equal to eager" if k in _CHECKED else "compiled")
            for k, v in sorted(_STATE.items())}


def _compile(key: Key) -> Callable | str:
    """The compiled function of key, lazily compiled at its first call; or why there is none."""
    if not torch._dynamo.is_dynamo_supported():
        return _go_eager(key, "torch.compile is not supported here (torch._dynamo.is_dynamo_supported() is false)")
    kind, tile, _ = key
    group = GROUPINGS[kind]

    def fused(x: torch.Tensor, qmax: torch.Tensor):
        return group(x, tile, qmax)

    _STATE[key] = torch.compile(fused, fullgraph=True, options=_OPTIONS, **_COMPILE_KW)
    return _STATE[key]


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises (no C++ compiler, no Triton, a graph break, the recompile limit)."""
    exc = torch._dynamo.exc
    limit = getattr(exc, "FailOnRecompileLimitHit", exc.TorchDynamoException)  # not a TorchDynamoException
    return exc.TorchDynamoException, limit, ImportError, OSError


def _eager(x: torch.Tensor, kind: str, tile: int) -> QTensor:
    return QTensor(*GROUPINGS[kind](x, tile), kind, tile)


def _go_eager(key: Key, why: str) -> str:
    """The one place the fused quantiser gives up: that key runs eagerly from here on, said once."""
    _STATE[key] = why
    warnings.warn(f"precision.fused_quant: the compiled {key[0]} quantiser (tile {key[1]}, {key[2]}) runs eagerly "
                  f"from here on: {why}", RuntimeWarning, stacklevel=3)
    return why


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else ""
