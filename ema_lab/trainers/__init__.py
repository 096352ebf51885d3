"""ema_lab inside the trainers people use: each module imports its trainer only when it is imported itself.

- :mod:`ema_lab.trainers.timm`: ``ModelEmaV3``, timm's class of that name run by ``ema_lab.ModelEMA``.
- :mod:`ema_lab.trainers.lightning`: ``EMACallback``, a Lightning callback.

accelerate and plain DDP need no glue: docs/trainers.md has their recipes.
"""
