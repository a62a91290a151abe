"""What the doctor concludes about one incident: its class, where it starts, the checks behind it, and its
judgement. Plain data, read by the report, the fix and the proof (doctor/report.py, classes, verify.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from doctor.timeline import Deviation

# an incident's verdict (doctor/judge.py): an execution fault, the run's own behaviour, or the recipe's own damage
FAULT, NATURAL, INSTABILITY = "fault", "natural", "instability"


@dataclass
class Judgement:
    verdict: str                 # FAULT | NATURAL | INSTABILITY
    reason: str                  # one line
    evidence: dict = field(default_factory=dict)


@dataclass
class Check:
    """A hypothesis the records support (holds True), reject (False) or cannot test (None), with the numbers."""
    name: str
    holds: bool | None
    evidence: str


@dataclass
class Diagnosis:
    fault_class: str
    summary: str
    anomaly: Deviation | None
    step: int | None
    rank: str | None
    batch: dict | None                  # {step, first, size}: the reproducible batch
    symptom: tuple[str, str, str] | None
    model_layer: str | None = None      # the model layer the diagnosis names (first non-finite, or the anomaly's)
    tree: list[tuple[str, str]] = field(default_factory=list)  # (decision-tree node, what the records say)
    confirmed: list[Check] = field(default_factory=list)
    rejected: list[Check] = field(default_factory=list)
    untestable: list[Check] = field(default_factory=list)
    seg_index: int = 0                  # the segment of run.segments the incident is in
    incidents: list["Diagnosis"] = field(default_factory=list)  # every incident, in order (the first is this)
    environment: str | None = None      # a machine-wide slowdown: not the run's fault
    devs: dict = field(default_factory=dict)  # the deviations the diagnosis was drawn from
    layer: str | None = None            # the timeline layer the diagnosis names, when not the quantity's own
    judgement: Judgement | None = None  # natural, a recipe instability or a fault, with its evidence
    source: str | None = None           # the data source the diagnosis names (a distribution shift)
    lever: dict | None = None           # a recipe instability's lever (doctor/levers.py), with its evidence
