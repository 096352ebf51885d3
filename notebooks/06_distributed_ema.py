# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · EMA when training outgrows one device: DDP and sharded (FSDP2) EMA
#
# Teams that keep an EMA of their weights usually train on many GPUs. The two common ways to spread
# training over processes treat the weights very differently, and so must the EMA:
#
# - **DDP** (`DistributedDataParallel`) keeps a full copy of the model on every rank and averages the
#   gradients in backward. Every rank then takes the same optimizer step.
# - **FSDP2** (`torch.distributed.fsdp.fully_shard`) keeps only a *shard* of every parameter on each rank,
#   as a `DTensor`; it gathers the full weights just for forward and backward.
#
# **You will learn**
# - why an EMA needs no communication at all in either setting (it is elementwise);
# - why `ModelEMA` works unchanged on a DDP model, is bit-identical on every rank, and may live on rank 0 only;
# - why `ModelEMA` cannot wrap an FSDP2 model, and how `ShardedModelEMA` keeps only the local shards
#   (about 1/world of the memory) and updates them with one `_foreach_lerp_`;
# - how to get the full EMA for a checkpoint with `torch.distributed.checkpoint.state_dict`;
# - how all of that is checked: real processes on the gloo backend (CPU, 127.0.0.1), compared with a
#   single-process EMA fed the same averaged gradients, collectives counted with torch's `CommDebugMode`.

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt
import torch

from ema_lab.bench.environment import format_environment
from ema_lab.lessons.distributed import missing_apis, run_cli

torch.set_num_threads(1)
print(format_environment())
print("torch.distributed APIs missing here:", missing_apis() or "none")

# %% [markdown]
# The cell above records the versions and hardware. Everything distributed below runs on the CPU with the
# gloo backend, so it needs no GPU; if an API were missing from your torch, the demo would say
# "skipped: ..." and name it.
#
# ## 1. An EMA is elementwise, so it shards
#
# One EMA step is `ema = lerp(ema, model, 1 - d)`: every element only looks at the same element of the
# model. FSDP2 splits each parameter along its first dimension into `world` contiguous pieces (the last
# ones smaller when it does not divide evenly). So each rank can average *its* rows and never needs
# anyone else's. The cell splits a 5-row tensor between two "ranks" exactly the way `torch.chunk`
# (and FSDP2) does, updates the pieces with one `_foreach_lerp_`, and compares with the unsharded update.

# %%
g = torch.Generator().manual_seed(0)
ema_w, model_w = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
d = 0.9

whole = ema_w.clone().lerp_(model_w, 1 - d)  # one process, the whole tensor
shards = [piece.clone() for piece in ema_w.chunk(2)]  # rank 0 and rank 1 own these rows
torch._foreach_lerp_(shards, list(model_w.chunk(2)), 1 - d)  # each rank: its own rows, no messages

print("rows held per rank:", [s.shape[0] for s in shards])
print("shards of the update == update of the whole:", torch.equal(torch.cat(shards), whole))

# %% [markdown]
# The split is uneven (3 rows and 2 rows) and the result is still *bit*-identical: lerp computes each
# element on its own, with the same formula, whatever tensor it sits in. That is the whole idea of a
# sharded EMA. What is left is bookkeeping: finding the local shards, keeping the EMA's shards aligned
# with the model's, and gathering them when someone wants the full EMA.
#
# ## 2. DDP and FSDP2, side by side
#
# | | DDP | FSDP2 (`fully_shard`) |
# |---|---|---|
# | what a rank holds | the full model | a shard of every parameter (`DTensor`, `Shard(0)`) |
# | gradients | all-reduced (averaged) in backward | reduce-scattered (averaged) in backward |
# | after `optimizer.step()` | the same full weights on every rank | each rank: its updated shard |
# | EMA | `ModelEMA(ddp_model)`: unwraps `.module`, a full copy | `ShardedModelEMA(model)`: a copy of the local shards |
# | collectives in `ema.update()` | none | none |
# | full EMA for a checkpoint | any rank's `ema.ema.state_dict()` | `ema.full_state_dict()`: one gather, via DCP |
#
# With DDP every rank steps to the same weights, so every rank's EMA stays identical without talking
# to the others; and since `update()` never waits for another rank, keeping the EMA on rank 0 only
# (`ddp_model_ema(model, rank0_only=True)`) saves the memory elsewhere and cannot deadlock.
#
# With FSDP2, `ModelEMA` cannot work the same way: it deep-copies the model, and a `fully_shard` module
# refuses to be deep-copied ("FSDP does not support deepcopy"), so `ModelEMA` checks for `FSDPModule`
# first and raises a `TypeError` that points to `ShardedModelEMA`. A full copy per rank would also
# defeat the point of sharding.
# `ShardedModelEMA` instead clones each parameter's local shard (a `DTensor` clones only its shard) into
# a module that holds them as `DTensor`s under the model's names, and updates the plain local tensors
# with the same validated strategies as `ModelEMA` (one `_foreach_lerp_` for a single-dtype model).
#
# ## 3. Running it for real: two processes, gloo, 127.0.0.1
#
# `python -m ema_lab.lessons.distributed --world-size 2` starts two processes with `torch.multiprocessing`, which
# join one process group through a store the parent opened on a free loopback port. Each rank trains the
# tiny transformer from `ema_lab.lessons.models` (2 blocks, an output head tied to the embedding) on its half of
# each global batch, first with DDP and `ModelEMA`, then with FSDP2 and `ShardedModelEMA`. The parent then
# trains the same model in one process on the whole batch, which gives the same averaged gradient, and
# compares. It exits non-zero on any mismatch and gives up after a time limit, killing its workers.
#
# The notebook runs it in a separate interpreter, exactly as you would from a shell. Its full output
# contains timings, so it is not compared when the notebook is tested; the cells after it print the
# deterministic parts.

# %%
# NBVAL_IGNORE_OUTPUT
rc, output, summary = run_cli(world_size=2)
print(output)

# %% [markdown]
# The table has one row per rank; "update ms" is the median of 20 extra `update()` calls at one thread,
# taken after the results were saved (noisy on a shared 2-core machine, not a benchmark).
# "aten ops/update" is what a `TorchDispatchMode` counter saw in the last checked update.
#
# Every check, as the JSON summary reports it:

# %%
print("exit status:", rc)
for name, passed in summary["checks"].items():
    print("ok  " if passed else "FAIL", name)

# %% [markdown]
# What they establish:
#
# - **identical to one process**: both the DDP EMA and the gathered FSDP2 EMA match the single-process
#   EMA to float32 rounding (the all-reduce adds the two half-batch gradients in a different order than
#   one big batch does). The reference EMA moved far from the initial weights, so this is not a trivial match.
# - **bit-identical on every rank** (DDP), and the rank-0-only EMA equals it.
# - **no collective during `update()`**: torch's `CommDebugMode` was active around every update of every
#   rank and counted zero collectives, for both DDP and FSDP2.
# - **one `_foreach_lerp_` and nothing else** per FSDP2 update (after the first, which also builds the
#   cached tensor lists): the local shards are plain tensors, so no `DTensor` dispatch is involved.
# - **the full EMA** was gathered by `get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`,
#   which leaves it on rank 0 only; loading the sharded EMA into a second FSDP2 model with `copy_to`
#   (no communication, shard to shard) and gathering that model gives the same tensors.
#
# ## 4. Memory per rank
#
# The point of the sharded EMA is memory. Bytes of EMA each rank holds (tied weights counted once):

# %%
fig_ = summary["figures"]
full = fig_["full_ema_bytes_reference"]
print(f"full EMA: {full:,} bytes")
for r in fig_["per_rank"]:
    print(
        f"rank {r['rank']}: DDP {r['ddp_ema_bytes']:,} B | DDP rank-0-only {r['ddp_rank0_only_bytes']:,} B | "
        f"FSDP2 shard {r['fsdp_ema_bytes']:,} B ({r['fsdp_fraction_of_full']:.2f} of full)"
    )
print("ModelEMA on the fully_shard model ->", fig_["fsdp_modelema_error"])

# %% [markdown]
# Each FSDP2 rank holds exactly half here because every tensor of this model has an even first dimension;
# with an odd one (or `--world-size 3`) the first ranks hold one row more, as in section 1. DDP keeps a
# full EMA on every rank unless you keep it on rank 0 only. The same numbers as a chart:

# %%
ranks = [r["rank"] for r in fig_["per_rank"]]
kinds = [
    ("DDP", "ddp_ema_bytes"),
    ("DDP, rank 0 only", "ddp_rank0_only_bytes"),
    ("FSDP2 shards", "fsdp_ema_bytes"),
]
fig, ax = plt.subplots(figsize=(7, 3.2))
for i, (label, key) in enumerate(kinds):
    ax.bar([x + 0.27 * (i - 1) for x in ranks], [r[key] / 1024 for r in fig_["per_rank"]], 0.27, label=label)
ax.axhline(full / 1024, color="k", lw=0.8, ls="--", label="one full EMA")
ax.set_xticks(ranks, [f"rank {x}" for x in ranks])
ax.set_ylim(0, 1.45 * full / 1024)  # room for the legend above the bars
ax.set_ylabel("EMA memory on the rank (KiB)")
ax.set_title("EMA memory per rank, tiny transformer, world size 2")
ax.legend(fontsize=8, loc="upper center", ncol=4)
plt.show()

# %% [markdown]
# ## 5. Checkpointing and evaluating a sharded EMA
#
# Three ways out of a `ShardedModelEMA`, all built on `torch.distributed.checkpoint` (DCP):
#
# ```python
# ema = ShardedModelEMA(model, decay=0.9999, tau=2000)   # model: fully_shard-ed, on every rank
# ...
# opt.step(); ema.update(model)                          # local, no collective
#
# # 1. a sharded checkpoint: every rank writes its own shards, nobody gathers
# import torch.distributed.checkpoint as dcp
# dcp.save({"ema": ema.sharded_state_dict()}, checkpoint_id="ckpt/step_1000")
#
# # 2. one ordinary file: gather on rank 0 (a collective, so call it on every rank)
# full = ema.full_state_dict(cpu_offload=True)           # {} on the other ranks
# if rank == 0:
#     torch.save(full, "ema.pt")
#
# # 3. evaluate: load the EMA, shard to shard, into an FSDP2 model sharded the same way
# ema.copy_to(eval_model)
# ```
#
# Call `update()` after `optimizer.step()`: between forward and backward FSDP2 may hold unsharded
# tensors in the module, and `ShardedModelEMA` then raises a `ValueError` naming the entry instead
# of averaging the wrong tensors (see `tests/test_distributed.py`).
#
# ## Try it yourself
#
# 1. Run `python -m ema_lab.lessons.distributed --world-size 3` from the repository root. Which ranks hold
#    more bytes, and why? (Hint: section 1, and the 64-row embedding.)
# 2. In section 1, chunk into 3 pieces and use a tensor of 7 rows: is the result still bit-identical?
# 3. Wrap `ema.update(model)` of a DDP model in `CommDebugMode` yourself, then wrap a `dist.all_reduce`
#    in it too: what does `get_total_counts()` say for each?
# 4. Why must `full_state_dict()` be called on *every* rank, even though only rank 0 receives the result?
#
# ## Summary
#
# - The EMA update is elementwise, so it commutes with sharding: each rank averages the rows it owns and
#   the result is bit-identical to averaging the whole tensor.
# - DDP: `ModelEMA` on the DDP model works as is; every rank holds the same EMA, no collective is issued, and
#   the EMA may live on rank 0 only.
# - FSDP2: `ModelEMA` cannot deep-copy a `fully_shard` model; `ShardedModelEMA` keeps the local shards only
#   (half of the EMA per rank at world size 2 here), updates them with one `_foreach_lerp_` and no
#   communication, and gathers the full EMA with DCP's `get_model_state_dict` when a checkpoint needs it.
# - Both are checked with real gloo processes against a single-process EMA fed the same averaged gradients.
