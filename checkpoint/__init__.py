"""Checkpointing as a consistency protocol: the state, atomic publish, async save, resume checks.

A reader only ever sees a complete snapshot (publish), resuming continues the run you would have had
(state + resume checks), and `python -m checkpoint.verify` proves it for a given config.
"""
import warnings

# NOTE: DCP warns on every single-process save/load that it "assumes" one process; here one process
# is a supported world size of the same code path, not a fallback.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

from checkpoint.checkpointer import (CheckpointFailed, Checkpointer, FinalCheckpointWithheld, RunComplete,
                                     resume_options)
from checkpoint.publish import check, resolve, step_name
from checkpoint.saver import Saver
from checkpoint.state import TrainState, read_blobs, read_tensors

__all__ = ["CheckpointFailed", "Checkpointer", "FinalCheckpointWithheld", "RunComplete", "Saver", "TrainState", "check", "read_blobs",
           "read_tensors", "resolve", "resume_options", "step_name"]
