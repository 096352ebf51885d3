"""ema_lab: teach, reproduce and benchmark a batched EMA weight update for PyTorch models."""

from .counting import count_kernel_launches, count_ops
from .ema import STRATEGIES, ModelEMA
from .gates import foreach_lerp_supported
from .profiling import check_movable, profile_flops, remove_thop_buffers, state_dict_diff
from .sharded import ShardedModelEMA
from .updates import foreach_update, gated_update, loop_update

__version__ = "0.1.0"

__all__ = [
    "ModelEMA",
    "ShardedModelEMA",
    "STRATEGIES",
    "foreach_lerp_supported",
    "loop_update",
    "foreach_update",
    "gated_update",
    "profile_flops",
    "state_dict_diff",
    "remove_thop_buffers",
    "check_movable",
    "count_ops",
    "count_kernel_launches",
    "__version__",
]
