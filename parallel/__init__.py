"""Process groups, reductions and model wrapping. Nothing here knows about the model or the data."""
from parallel.dist import Dist, all_reduce_max, all_reduce_sum, barrier, broadcast_object, destroy, init_distributed, release
from parallel.wrap import wrap_model

__all__ = ["Dist", "all_reduce_max", "all_reduce_sum", "barrier", "broadcast_object", "destroy", "init_distributed", "release", "wrap_model"]
