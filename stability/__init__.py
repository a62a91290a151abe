"""Stability engineering inside the step: the step record and its sinks, input stats and per-layer
telemetry, the spike detector, the guard (skip / rollback / anticipatory routing), events and fault
injection. The offline analysis of a finished run lives in doctor/."""
