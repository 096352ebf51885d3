"""The post-hoc EMA's snapshot store, under the name it is documented by: it lives beside ``PostHocEMA``, in
:mod:`ema_lab.posthoc`."""

from . import posthoc

Snapshot, check_folder, save_step = posthoc.Snapshot, posthoc.check_folder, posthoc.save_step
list_snapshots, load_snapshot = posthoc.list_snapshots, posthoc.load_snapshot
FIELDS, FORMAT, MAX_STEP = posthoc.FIELDS, posthoc.FORMAT, posthoc.MAX_STEP  # what a snapshot file holds

__all__ = ["Snapshot", "check_folder", "save_step", "list_snapshots", "load_snapshot"]
