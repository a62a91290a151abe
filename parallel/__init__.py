"""Process groups, reductions, the step's one host transfer and model wrapping. Nothing here knows about the
model or the data."""
from parallel.dist import Dist, all_reduce_max, all_reduce_sum, barrier, broadcast_object, destroy, init_distributed, release
from parallel.host_scalars import HostScalars
from parallel.wrap import wrap_model

__all__ = ["Dist", "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_object", "destroy", "HostScalars", "init_distributed", "release", "wrap_model"]
