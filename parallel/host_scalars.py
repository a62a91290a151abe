"""The numbers one step needs on the host, read in one transfer.

    host = HostScalars()
    host.put(loss_sums_K=packed_K, grad_norm=norm)   # device tensors, named, as the step computes them
    host.read()                                      # ONE device-to-host copy of everything put so far
    host["grad_norm"]                                # a float (0-d), a list (1-d), nested lists (n-d)

On a GPU every `.item()` / `.tolist()` / float(t) waits for every kernel queued before it, and the host
stops queueing new ones meanwhile: a step that reads its scalars one at a time stalls once per scalar.
Collected here, they cost one wait. read() may be called again for what was put after it (the guard's
veto needs the pre-update numbers before the update: train.py), and counts the transfers it made.

NOTE: the copy is float64: exact for every float32 / float16 / bfloat16 value, every bool and every
integer below 2^53 (token counts, sample ids, content hashes), so a value reads back exactly as its own
`.item()` would have.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


class HostScalars:
    def __init__(self) -> None:
        self._pending: dict[str, Tensor] = {}
        self._values: dict[str, float | list] = {}
        self.reads = 0

    def put(self, **named: Tensor) -> None:
        for name, t in named.items():
            if name in self._pending or name in self._values:
                raise KeyError(f"HostScalars: {name!r} is already put this step")
            self._pending[name] = t.detach()

    def read(self) -> None:
        """Copy every tensor put since the last read to the host, in one transfer."""
        if not self._pending:
            return
        packed = Packed(self._pending)
        self._values.update(packed.unpack(packed.flat().tolist()))
        self.reads += 1
        self._pending = {}

    def __getitem__(self, name: str) -> float | list:
        if name not in self._values:
            where = "put but not read yet" if name in self._pending else "never put"
            raise KeyError(f"HostScalars: {name!r} is {where}")
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def names(self) -> list[str]:
        """What has been read, in the order it was put."""
        return list(self._values)


class Packed:
    """Named tensors laid end to end in one flat float64 vector, for one collective or one host transfer, and
    taken apart by name again: where each one lies follows from the names, in the order given, never from
    index arithmetic at the call site.

        packed = Packed({"grad_sq": g_L, "act_sq": a_A}, device)
        flat = all_reduce_sum(packed.flat())     # one collective (or flat.tolist(): one transfer)
        packed.unpack(flat)["act_sq"]            # a view of flat, shaped (A,); from a list, nested lists
    """

    def __init__(self, named: dict[str, Tensor], device: torch.device | None = None,
                 dtype: torch.dtype = torch.float64):
        self.named = dict(named)
        self.shapes = {k: tuple(t.shape) for k, t in self.named.items()}
        self.device = device if device is not None else next(iter(self.named.values())).device
        self.dtype = dtype

    def flat(self) -> Tensor:
        if not self.named:
            return torch.zeros(0, dtype=self.dtype, device=self.device)
        return torch.cat([t.reshape(-1).to(self.device, self.dtype) for t in self.named.values()])

    def unpack(self, flat: Tensor | list[float]) -> dict[str, Tensor | float | list]:
        """By name, each shaped as put: views of a tensor, or (of the host's list) a float, lists, nested lists."""
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            part = flat[at:at + n]
            out[name] = part.view(shape) if torch.is_tensor(part) else _shaped(part, shape)
            at += n
        if at != len(flat):
            raise ValueError(f"Packed.unpack: {len(flat)} numbers for {at} packed")
        return out


def _shaped(flat: list[float], shape: tuple[int, ...]):
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_shaped(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
