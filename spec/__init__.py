"""spec: the step's specification checks — what it should have computed, checked exactly, at its step.

spec/check.py (a check's declaration), spec/tolerance.py (tolerances from the precision recipe), spec/reference.py
(the FP64 reference model), spec/probe.py (the probe through both), spec/checks/ (one file per check),
spec/monitor.py (the callback that runs them in the step). docs/spec.md tells the story.
"""
