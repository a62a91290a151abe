"""The speed anchor, nanoGPT itself, loaded from a checkout the user points at (never part of ballast).

    NANOGPT_DIR=/path/to/nanoGPT   (karpathy/nanoGPT at 3adf61e; its data/shakespeare_char/prepare.py run)

Its README's CPU command trains 4 layers × 4 heads × width 128, context 64, batch 12, dropout 0, LayerNorm
and Linear without bias, learned positions, GELU MLP of width 4·128, tied head; AdamW lr 1e-3 → 1e-4
cosine over 2000 iterations (100 warm-up), β2 0.99, weight decay 0.1 on every ≥2-D tensor, clip 1.0.
This module builds that model from the checkout's own model.py and optimizer (configure_optimizers),
draws its batches the way its train.py does (fresh random windows of its train.bin each step), and
evaluates a model of it on ballast's fixed validation set, so both are judged by one protocol.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

# nanoGPT's README CPU command (and config/train_shakespeare_char.py beneath it)
CPU_COMMAND = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, dropout=0.0, bias=False,
                   lr=1e-3, min_lr=1e-4, warmup=100, decay_iters=2000, betas=(0.9, 0.99), weight_decay=0.1,
                   grad_clip=1.0, max_iters=2000)


def nanogpt_dir(arg: str | None = None) -> Path:
    """The checkout: `arg`, else $NANOGPT_DIR; a one-line error when neither points at one."""
    d = arg or os.environ.get("NANOGPT_DIR")
    if not d:
        sys.exit("bench: set NANOGPT_DIR (or pass --nanogpt) to a karpathy/nanoGPT checkout")
    p = Path(d).expanduser().resolve()
    for need in ("model.py", "train.py"):
        if not (p / need).is_file():
            sys.exit(f"bench: NANOGPT_DIR={p}: no {need} (not a nanoGPT checkout)")
    return p


def load_model_module(root: Path):
    """nanoGPT's model.py as a module named nanogpt_model (ballast has its own package `model`)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", root / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_bin(root: Path) -> Path:
    path = root / "data" / "shakespeare_char" / "train.bin"
    if not path.is_file():
        sys.exit(f"bench: {path} missing: run nanoGPT's data/shakespeare_char/prepare.py first")
    return path


def build(root: Path, vocab_size: int, quiet: bool = True):
    """(model, optimizer) of the README's CPU command, from the checkout's own code."""
    import contextlib
    import io

    mod = load_model_module(root)
    c = CPU_COMMAND
    conf = mod.GPTConfig(block_size=c["block_size"], vocab_size=vocab_size, n_layer=c["n_layer"],
                         n_head=c["n_head"], n_embd=c["n_embd"], dropout=c["dropout"], bias=c["bias"])
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():  # its prints
        model = mod.GPT(conf)
        opt = model.configure_optimizers(c["weight_decay"], c["lr"], c["betas"], "cpu")
    return model, opt


def lr_at(it: int) -> float:
    """nanoGPT's schedule: linear warm-up over `warmup` (+1) iterations, then cosine to min_lr."""
    c = CPU_COMMAND
    if it < c["warmup"]:
        return c["lr"] * (it + 1) / (c["warmup"] + 1)
    if it > c["decay_iters"]:
        return c["min_lr"]
    ratio = (it - c["warmup"]) / (c["decay_iters"] - c["warmup"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c["lr"] - c["min_lr"])


class Batches:
    """nanoGPT's train-batch draw: re-open train.bin as a memmap each step (as its train.py does, to keep
    memory flat), B random windows of T + 1 tokens, stacked as int64 inputs and targets."""

    def __init__(self, root: Path, seed: int = 1337):
        self.path = train_bin(root)
        self.g = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = CPU_COMMAND["batch_size"], CPU_COMMAND["block_size"]
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        starts = torch.randint(len(data) - T, (B,), generator=self.g).tolist()
        w = torch.stack([torch.from_numpy(data[s:s + T + 1].astype(np.int64)) for s in starts])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def make_step(model, opt, batches: Batches, forward=None):
    """One iteration of nanoGPT's loop on CPU: set the lr, forward, backward, clip, step, zero_grad, and
    the loss read its README command logs every iteration (log_interval=1)."""
    forward = model if forward is None else forward
    it = [0]

    def step() -> float:
        for g in opt.param_groups:
            g["lr"] = lr_at(it[0])
        x, y = batches.next()
        _, loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CPU_COMMAND["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        it[0] += 1
        return loss.item()

    return step


@torch.no_grad()
def eval_loss(model, batches) -> float:
    """Mean loss per token of a nanoGPT model on ballast's fixed validation batches (eval_batches)."""
    was = model.training
    model.eval()
    tot = n = 0.0
    for b in batches:
        _, loss = model(b.tokens, b.labels)  # nanoGPT's mean CE over the batch's tokens
        tot += loss.item() * b.labels.numel()
        n += b.labels.numel()
    model.train(was)
    return tot / n


def load_checkpoint(root: Path, ckpt: Path):
    """A model of nanoGPT's from a ckpt.pt its train.py wrote; (model, iter_num)."""
    mod = load_model_module(root)
    sd = torch.load(ckpt, map_location="cpu", weights_only=False)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        model = mod.GPT(mod.GPTConfig(**sd["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in sd["model"].items()}
    model.load_state_dict(state)
    return model, int(sd["iter_num"])
