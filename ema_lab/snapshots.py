"""The post-hoc EMA's snapshot store, under the name the docs give it: it lives in :mod:`ema_lab.posthoc`."""

from . import posthoc
from .posthoc import Snapshot, check_folder, list_snapshots, load_snapshot, save_step

FIELDS, FORMAT, MAX_STEP = posthoc.FIELDS, posthoc.FORMAT, posthoc.MAX_STEP  # what a snapshot file holds

__all__ = ["Snapshot", "check_folder", "save_step", "list_snapshots", "load_snapshot"]
