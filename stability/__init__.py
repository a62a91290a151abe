"""Stability engineering. Online: the step record and its sinks, input stats and per-layer telemetry,
the spike detector, the guard (skip / rollback / anticipatory routing), events and fault injection.
Offline: the doctor (a fault report from a run's own records) and single-batch replay."""
