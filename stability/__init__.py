"""Stability engineering: the step record and its sinks (online), and later the guard and the doctor."""
