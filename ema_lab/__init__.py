"""ema_lab: an EMA of model weights updated with one batched ``torch._foreach_lerp_`` (or one flat ``lerp_``).

The core needs torch alone; where each piece lives: docs/api.md, "The files"."""

from .ema import STRATEGIES, ModelEMA
from .flatten import flatten_model, flatten_tensors, unflatten_model
from .gates import foreach_lerp_supported
from .posthoc import PostHocEMA
from .sharded import ShardedModelEMA
from .updates import foreach_update, gated_update, loop_update

__version__ = "0.1.0"

__all__ = ["ModelEMA", "PostHocEMA", "ShardedModelEMA", "STRATEGIES", "loop_update", "foreach_update"]
__all__ += ["gated_update", "foreach_lerp_supported", "flatten_model", "unflatten_model", "flatten_tensors"]
__all__ += ["__version__"]
