"""Where StepRecords go: a JSONL file (the source of truth), the console, and wandb.

Only rank 0 builds sinks; other ranks get an empty list, so the loop never asks which rank it is.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from tqdm.auto import tqdm

from stability.config import LoggingConfig
from stability.record import StepRecord


class JsonlSink:
    def __init__(self, path: Path):
        # NOTE: line buffering, so a crash or SIGKILL loses at most the line being written.
        self.path = path
        self.f = open(path, "a", buffering=1)

    def write(self, rec: StepRecord) -> None:
        try:
            self.f.write(rec.to_json() + "\n")
        except OSError as e:  # a full disk: the error names the file (a write's own error does not)
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self) -> None:
        self.f.close()


class ConsoleSink:
    """A progress bar on a terminal, plus one compact line every `every` steps and on every evaluation
    or event. Off a terminal (CI, `> log`) only the plain lines: a bar there is hundreds of
    carriage-return redraws a minute in the file."""

    def __init__(self, total_steps: int, every: int, floor: float | None, progress: bool):
        self.every, self.floor = every, floor
        # NOTE: tqdm draws on stderr, so stderr's TTY-ness decides; looked up now, not at import, so a
        # redirected stream (tests, a wrapper) is the one asked.
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not (progress and sys.stderr.isatty()))
        self._said: set[str] = set()

    def say(self, line: str) -> None:
        """A line now (what the start did: a resume, a clean-up), left off the step line whose record holds it."""
        self._line(line)
        self._said.add(line)

    def _line(self, text: str) -> None:
        if self.bar.disable:  # flushed per line: a log file tailed during a run shows each line as it comes
            print(text, flush=True)
        else:
            self.bar.write(text)  # above the bar, which is redrawn below it

    def write(self, rec: StepRecord) -> None:
        if not self.bar.disable:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec.loss:.4f}", gnorm=f"{rec.grad_norm:.3f}", refresh=False)
        if rec.eval is not None:
            ev = rec.eval
            gap = f" (floor {ev['floor']:.4f}, gap {ev['loss'] - ev['floor']:+.4f})" if ev.get("floor") is not None else ""
            self._line(f"eval  step {rec.step:>6} | val loss {ev['loss']:.4f}{gap}")
        events = [e for e in rec.events if e not in self._said]
        self._said.difference_update(rec.events)
        if self.every and (rec.step % self.every == 0 or events):
            ev = f" | {'; '.join(events)}" if events else ""
            self._line(
                f"step {rec.step:>6} | loss {rec.loss:.4f} | lr {rec.lr:.2e} | gnorm {rec.grad_norm:.3f}"
                f" clip {rec.clip_coef:.2f} | {rec.tokens_per_s / 1e3:.1f}k tok/s"
                f" | {rec.time_s.get('total', math.nan) * 1e3:.0f} ms{ev}"
            )

    def close(self) -> None:
        self.bar.close()


class WandbSink:
    """wandb on rank 0 only, offline by default, written under the run directory."""

    def __init__(self, mode: str, project: str, run_dir: Path, name: str, config: dict):
        import wandb  # imported lazily: a heavy import, never needed when disabled

        # NOTE: quiet: the run's records are metrics.jsonl and the console's lines; wandb's end-of-run history and
        # summary (some thirty lines) stay in its files
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), mode=mode, config=config,
                              settings=wandb.Settings(quiet=True))

    def write(self, rec: StepRecord) -> None:
        row = {"loss": rec.loss, "lr": rec.lr, "grad_norm": rec.grad_norm, "clip_coef": rec.clip_coef,
               "z_loss": rec.z_loss, "aux_loss": rec.aux_loss, "logit_max": rec.logit_max,
               "tokens_per_s": rec.tokens_per_s, "tokens": rec.tokens}
        row.update({f"loss/{k}": v for k, v in rec.loss_by_source.items()})
        if rec.eval is not None:
            row.update({f"eval/{k}": v for k, v in rec.eval.items() if isinstance(v, (int, float))})
        self.run.log(row, step=rec.step)

    def close(self) -> None:
        if self.run is not None:  # closed once: the run closes its sinks at the end and again after an error
            self.run.finish()
            self.run = None


def build_sinks(log_cfg: LoggingConfig, run_dir: Path, total_steps: int, floor: float | None, name: str,
                config: dict) -> list:
    """log_cfg: logging.*, checked by the schema; config: the resolved run config, for wandb's record."""
    mode = log_cfg.wandb
    sinks = [JsonlSink(run_dir / "metrics.jsonl"), ConsoleSink(total_steps, log_cfg.log_every, floor, log_cfg.progress)]
    if mode != "disabled":
        sinks.append(WandbSink(mode, log_cfg.wandb_project, run_dir, name, config))
    return sinks
