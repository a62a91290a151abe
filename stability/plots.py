"""End-of-run picture: train and eval loss with the exact loss floor of the evaluation tokens."""
from __future__ import annotations

from pathlib import Path


def plot_losses(records: list[dict], path: Path, floor: float | None) -> None:
    # NOTE: imported by a run that draws, at its end: pyplot is among the slowest imports of a start
    import matplotlib
    matplotlib.use("Agg")  # NOTE: headless; never needs a display
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records], lw=0.8, alpha=0.8, label="train loss")
    evals = [(r["step"], r["eval"]["loss"]) for r in records if r.get("eval")]
    if evals:
        ax.plot(*zip(*evals), "o-", ms=3, label="eval loss")
    if floor is not None:
        ax.axhline(floor, color="k", ls="--", lw=1, label=f"exact floor {floor:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats / token")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
