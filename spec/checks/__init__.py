"""The specification checks, registered in timeline order (the registry's order is the order in which a step's
failures are read: the state the step started from, its data, its forward, its gradient, its update, the system).
A new check is one module here, imported below in its place (docs/hacking.md)."""
from spec.checks import state, data, forward, route, final_norm, backward, clip, schedule, optimizer, balance  # noqa: F401,E401
from spec.checks import collectives  # noqa: F401
