# ---
# jupyter:
#   jupytext:
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · The EMA when training spans many processes: DDP and FSDP2
#
# - An EMA update is elementwise, so it needs no communication between processes.
# - With DDP, `ModelEMA` works unchanged; with FSDP2, `ShardedModelEMA` keeps only each process's shard.
# - BatchNorm's statistics differ by process: every process calls `ema.sync_buffers()` before evaluating.

# %% [markdown]
# ![Course map](figures/course_map_06.svg)
#
# Training on several GPUs runs one process per GPU, called a *rank*; each holds the weights or, when the
# model is sharded, a slice of them. Can each rank keep an EMA of what it holds, without asking the others?

# %% tags=["nbval-ignore-output"]
import json
import platform

import matplotlib.pyplot as plt
import torch

from ema_lab.lessons import scratch_dir
from ema_lab.lessons.distributed import skip_reason, torchrun

torch.set_num_threads(1)
workdir = scratch_dir("ema_lab_06_")  # a temporary folder for the scripts, deleted when the kernel stops
print(
    f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.machine()}"
)
print(skip_reason() or "torch.distributed: everything the runs below need is here")

# %% [markdown]
# ## 1. An EMA is elementwise, so it shards
#
# `lerp(ema, model, 1 - d)` computes each element from the same element of the model. Split a 5-row
# tensor in two pieces, as two ranks would hold it, and update each piece on its own:

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
# Uneven pieces (3 and 2 rows), and still bit-identical. What is left is bookkeeping: finding each
# rank's shards and gathering them when someone wants the full EMA.

# %% [markdown]
# A *collective* is an operation every rank must call together, such as an all-reduce (every rank ends
# with the sum of everyone's tensors). Two ways to train on many ranks:
#
# - **DDP** (`DistributedDataParallel`) keeps the full model on every rank and all-reduces the
#   gradients in backward: every rank takes the same step, so the EMA of the *parameters* is the same
#   everywhere, with no collective.
# - **FSDP2** (`fully_shard`) keeps a row-slice (*shard*) of every parameter on each rank, as a DTensor
#   (a tensor that knows it is one shard of a larger one).
#
# ![FSDP2 splits 5 rows over 4 ranks as 2/2/1/0](figures/06_fsdp_rows.svg)
#
# `ema_lab.ShardedModelEMA` is the update above, packaged: it copies each rank's local shards and
# updates them with one `_foreach_lerp_`, with no message to the other ranks.

# %% [markdown]
# ## 2. Buffers differ by rank
#
# BatchNorm's `running_mean` and `running_var` move in every training forward, from the batch each rank
# sees: its own part. DDP (by default) copies rank 0's buffers to the others at the start of each
# forward, then each rank's BatchNorm moves them again; FSDP2 never copies them. So the EMA's buffers
# differ by rank.

# %% [markdown]
# A *broadcast*, a collective that copies one rank's tensor into the same tensor on every other rank,
# fixes that. By hand: give each of two ranks' BatchNorm its own batch, update an EMA, then broadcast each
# EMA buffer from rank 0. `%%writefile` saves the cell as a script in the first cell's temporary folder;
# `torchrun(2, script)` runs it on two ranks and returns what they printed:

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/sync_by_hand.py
"""Two ranks' EMAs of a BatchNorm differ; a broadcast of each buffer from rank 0 makes them equal."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from ema_lab import ModelEMA


def gathered(value: object) -> list:
    """Every rank's ``value``, on every rank (a collective: to print them on rank 0)."""
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, value)
    return copies


def rounded(t: torch.Tensor) -> list[float]:
    return [round(v, 3) for v in t.tolist()]


dist.init_process_group("gloo")  # torchrun told each process its rank and where the others are
rank = dist.get_rank()
bn = nn.BatchNorm1d(3)
by_hand, packaged = ModelEMA(bn), ModelEMA(bn)
bn(torch.randn(8, 3, generator=torch.Generator().manual_seed(rank)) + rank)  # this rank's own batch
by_hand.update(bn, decay=0.0)  # decay 0: the EMA copies the model, to see the difference clearly
packaged.update(bn, decay=0.0)
before = gathered(rounded(by_hand.ema.running_mean))

for buffer in by_hand.ema.buffers():  # the sync by hand: every rank calls it, rank 0 sends
    dist.broadcast(buffer, src=0)
packaged.sync_buffers()  # ema_lab's version

after = gathered(rounded(by_hand.ema.running_mean))
same = gathered(all(torch.equal(a, b) for a, b in zip(by_hand.ema.buffers(), packaged.ema.buffers())))
if rank == 0:
    print("the EMA's running_mean on rank 0, rank 1, after update():", before)
    print("after the broadcast from rank 0:                       ", after)
    print("sync_buffers() gives the same buffers, on each rank:", same)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # see the training script below: torch's communication threads can outlive the group

# %% tags=["nbval-ignore-output"]
print(skip_reason() or torchrun(2, workdir / "sync_by_hand.py"))

# %% [markdown]
# Before: each rank's own statistics. After: rank 0's everywhere. `ema.sync_buffers()` packages this loop
# for the float buffers, sending each dtype's buffers as one flat tensor: one broadcast per dtype (here
# one per EMA), not one per buffer. In a group of one rank there is no one to send to, and it sends
# nothing.

# %% [markdown]
# ## 3. One training script, DDP then FSDP2
#
# A real run: a small MLP with a BatchNorm, trained on two ranks with DDP and `ModelEMA`, then with FSDP2
# and `ShardedModelEMA`; the ranks talk over *gloo*, PyTorch's CPU backend. Four files, one idea each.
# First what both runs share: the model, and a training loop that counts the collectives of
# `ema.update()` with torch's `CommDebugMode`:

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/shared.py
"""The model and the training loop of both runs."""

import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

STEPS, BATCH_PER_RANK, LR, DECAY, TAU = 6, 4, 0.1, 0.9, 2  # a short ramp: the EMA moves visibly


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same initial weights in every process; first dimensions 64, 64 (BatchNorm), 5 and 3."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.BatchNorm1d(64), nn.SiLU(), nn.Linear(64, 5), nn.SiLU(), nn.Linear(5, 3)]
    return nn.Sequential(*layers).to(dtype)


def train(model: nn.Module, ema, parts: list[slice], world: int, dtype=torch.float32) -> int:
    """SGD on ``parts`` of each global batch, the EMA updated after every step; the collectives it issued."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    collectives = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)  # the same global batch in every process
        n = BATCH_PER_RANK * world
        x, y = torch.randn(n, 16, generator=g).to(dtype), torch.randn(n, 3, generator=g).to(dtype)
        opt.zero_grad()
        # BatchNorm normalises each part with that part's statistics, as each rank does with its own.
        loss = sum(nn.functional.mse_loss(model(x[p]), y[p]) for p in parts) / len(parts)
        loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters: gradients averaged over ranks
        opt.step()
        with CommDebugMode() as comm:
            ema.update(model)  # local: no rank waits for another
        collectives += comm.get_total_counts()
    return collectives


def synced(ema, state) -> dict:
    """The EMA's state before ema.sync_buffers() and after, and the collectives of that call."""
    before = {k: v.clone() for k, v in state().items()}
    with CommDebugMode() as comm:
        ema.sync_buffers()  # every rank calls it: rank 0's buffers everywhere
    return {"before": before, "after": state(), "sync": comm.get_total_counts()}


# %% [markdown]
# DDP wraps the model; `ModelEMA` unwraps it (`.module`) and keeps a full copy on each rank:

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/with_ddp.py
"""DDP: every rank holds the whole model, and its EMA."""

from shared import DECAY, TAU, make_model, synced, train
from torch.nn.parallel import DistributedDataParallel

from ema_lab import ModelEMA


def run_ddp(part: slice, world: int) -> dict:
    ddp = DistributedDataParallel(make_model())
    ema = ModelEMA(ddp, decay=DECAY, tau=TAU)
    result = {"update": train(ddp, ema, [part], world), **synced(ema, ema.ema.state_dict)}
    result["bytes"] = sum(t.numel() * t.element_size() for t in ema.ema.state_dict().values())
    return result


# %% [markdown]
# FSDP2 shards over a *device mesh* (the ranks, in a row): `fully_shard` on each `Linear`, then on the
# whole model, makes every parameter a DTensor. `ModelEMA` refuses it; `ShardedModelEMA` keeps the local
# shards, and `full_state_dict()` gathers them (a collective) for the check:

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/with_fsdp2.py
"""FSDP2: each rank holds a dim-0 shard of every parameter; its EMA keeps only those."""

from shared import DECAY, TAU, make_model, synced, train
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ema_lab import ModelEMA, ShardedModelEMA


def run_fsdp2(part: slice, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        ModelEMA(model)  # deep-copies the model: refused for FSDP2
    except TypeError as e:
        refused = f"{type(e).__name__}: {str(e).split(':')[0]}"
    ema = ShardedModelEMA(model, decay=DECAY, tau=TAU)
    result = {"update": train(model, ema, [part], world), "refused": refused, "bytes": ema.local_bytes()}
    result["shard shapes"] = {k: list(t.shape) for k, t in ema.local_tensors().items()}
    # cpu_offload=False: every rank gets the whole EMA, to compare the ranks
    return result | synced(ema, lambda: ema.full_state_dict(cpu_offload=False))


# %% [markdown]
# The script torchrun starts: each rank runs both; rank 0 gathers what every rank holds and checks the
# EMAs against the same model trained alone, in float64:

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/train_ema.py
"""DDP + ModelEMA, then FSDP2 + ShardedModelEMA, of an MLP with a BatchNorm; rank 0 checks both."""

import json
import os
import sys

import torch
import torch.distributed as dist
from shared import BATCH_PER_RANK, DECAY, TAU, make_model, train
from with_ddp import run_ddp
from with_fsdp2 import run_fsdp2

from ema_lab import ModelEMA

BUFFERS = ("1.running_mean", "1.running_var", "1.num_batches_tracked")  # the BatchNorm's

dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
part = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)  # this rank's part of each batch
mine = {"DDP": run_ddp(part, world), "FSDP2": run_fsdp2(part, world)}
ranks = [None] * world
dist.all_gather_object(ranks, mine)  # what each rank holds, gathered to print it on rank 0
if rank == 0:
    ref_model = make_model(torch.float64)  # one process, every rank's part, float64
    ref = ModelEMA(ref_model, decay=DECAY, tau=TAU)
    all_parts = [slice(r * BATCH_PER_RANK, (r + 1) * BATCH_PER_RANK) for r in range(world)]
    train(ref_model, ref, all_parts, world, torch.float64)
    params = {k: v.float() for k, v in ref.ema.state_dict().items() if k not in BUFFERS}
    print(f"world size {world}: EMA of the parameters equals the float64 one-process EMA (assert_close)")
    print("BatchNorm buffers of the EMA, largest difference between rank 0 and another rank:")
    for kind in ("DDP", "FSDP2"):
        before, after = [r[kind]["before"] for r in ranks], [r[kind]["after"] for r in ranks]
        for state in after:
            torch.testing.assert_close({k: state[k] for k in params}, params)
        apart = max((s[k] - before[0][k]).abs().max().item() for s in before for k in BUFFERS)
        equal = all(torch.equal(s[k], after[0][k]) for s in after for k in after[0])
        print(f"  {kind:<5} after update(): {apart:.1e}   after sync_buffers(): every entry equal: {equal}")
    print(f"ModelEMA(fully_shard model) -> {ranks[0]['FSDP2']['refused']}")
    print("FSDP2 shard rows per rank:")
    for k, shape in ranks[0]["FSDP2"]["shard shapes"].items():
        if shape:  # not the BatchNorm's counter, a single number
            print(f"  {k:<19} {'/'.join(str(r['FSDP2']['shard shapes'][k][0]) for r in ranks)}")
    table = {
        "DDP EMA bytes": [r["DDP"]["bytes"] for r in ranks],
        "FSDP2 EMA bytes": [r["FSDP2"]["bytes"] for r in ranks],
        "collectives in update()": [r["DDP"]["update"] + r["FSDP2"]["update"] for r in ranks],
        "collectives in the two sync_buffers()": [r["DDP"]["sync"] + r["FSDP2"]["sync"] for r in ranks],
    }
    for key, values in table.items():
        print(f"{key + ' per rank:':<48} {values}")
    if len(sys.argv) > 1:  # for the notebook's chart
        with open(sys.argv[1], "w") as f:
            json.dump({k: table[k] for k in ("DDP EMA bytes", "FSDP2 EMA bytes")}, f)
dist.barrier()  # no rank tears its connections down while rank 0 still checks
dist.destroy_process_group()
# End the process here: torch's communication threads can outlive the group and crash a finished
# process during Python's normal shutdown.
sys.stdout.flush()
os._exit(0)

# %% [markdown]
# torchrun gives each rank its number (`RANK`), the number of ranks (`WORLD_SIZE`) and a free local port
# where they meet (`--standalone`). A run takes several seconds:

# %% tags=["nbval-ignore-output"]
print(skip_reason() or torchrun(2, workdir / "train_ema.py", "memory_2.json"))

# %% [markdown]
# The EMA of the parameters matches the one-process float64 EMA on every rank, with zero collectives in
# `update()`. The BatchNorm buffers differ, more under FSDP2, which never copies buffers, until
# `sync_buffers()` (one collective per EMA) gives every rank rank 0's.

# %% [markdown]
# The 64 rows split 32/32, the 5 rows 3/2, the 3 rows 2/1. FSDP2 gives each rank `ceil(rows / world
# size)` rows until the rows run out, as in the picture of section 1. On four ranks:

# %% tags=["nbval-ignore-output"]
print(skip_reason() or torchrun(4, workdir / "train_ema.py", "memory_4.json"))

# %% [markdown]
# 5 rows become 2/2/1/0 and 3 rows 1/1/1/0: rank 3 holds an *empty* shard, where its `_foreach_lerp_`
# has nothing to do, and the result still matches. `torch.chunk` splits the same way:

# %%
for rows, world in [(64, 3), (5, 4), (3, 4)]:
    sizes = [c.shape[0] for c in torch.empty(rows).chunk(world)]
    padded = sizes + [0] * (world - len(sizes))  # chunk returns fewer pieces; FSDP2 pads with empty shards
    print(f"{rows} rows over {world} ranks: {'/'.join(map(str, padded))}")

# %% [markdown]
# So 64 rows over 3 ranks are 22/22/20, not 22/21/21.

# %% [markdown]
# ## 4. Memory, evaluating and saving
#
# The point of sharding is memory. The bytes of EMA each rank held in the two runs:

# %% tags=["nbval-ignore-output"]
memory = {}
for world in (2, 4):
    path = workdir / f"memory_{world}.json"
    if path.exists():
        mem = memory[world] = json.loads(path.read_text())
        print(f"{world} ranks: DDP {mem['DDP EMA bytes']} B, FSDP2 {mem['FSDP2 EMA bytes']} B")

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True, layout="constrained")
for ax, (world, mem) in zip(axes, memory.items()):
    ranks = range(world)
    ax.bar([r - 0.2 for r in ranks], mem["DDP EMA bytes"], 0.4, color="tab:gray", label="DDP: ModelEMA")
    ax.bar(
        [r + 0.2 for r in ranks],
        mem["FSDP2 EMA bytes"],
        0.4,
        color="tab:blue",
        label="FSDP2: ShardedModelEMA",
    )
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_title(f"{world} ranks", fontsize=10)
axes[0].set_ylabel("EMA bytes on the rank")
handles, labels = axes[0].get_legend_handles_labels()
fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False)
plt.show()

# %% [markdown]
# DDP keeps a full EMA on every rank. Under FSDP2 each rank holds its shards plus a whole copy of the
# buffers, which are not sharded; the ranks with smaller or empty shards hold less.

# %% [markdown]
# **Evaluating and saving.** Before an evaluation or a checkpoint, every rank calls `ema.sync_buffers()`;
# then rank 0 alone may evaluate or save. `update()` warns once where the buffers will differ. The sync
# stays out of `update()`: a collective there would cost a message every step (1.1 to 6.3 ms on a CPU in a
# [reference run](../docs/results/sync-costs-2026-12-05.md)) for what is read once an evaluation, and
# would hang a run that keeps its EMA on rank 0 only.

# %% [markdown]
# `torch.distributed.checkpoint` (DCP) saves and loads sharded state, each rank writing its own part:
#
# ```python
# import torch.distributed.checkpoint as dcp
#
# ema.sync_buffers()  # on every rank
# dcp.save({"ema": ema.sharded_state_dict()}, checkpoint_id="ckpt/step_1000")  # no gathering
# full = ema.full_state_dict(cpu_offload=True)  # on every rank; gathers to rank 0
# ema.copy_to(eval_model)  # shard to shard, into an FSDP2 model sharded alike
# ```
#
# Call `update()` after `optimizer.step()`. Between forward and backward FSDP2 may hold gathered
# tensors, and `ShardedModelEMA` then raises a `ValueError` rather than average the wrong ones.

# %% [markdown]
# ## Summary
#
# - The EMA update is elementwise: each rank averages the rows it owns, bit-identical to the whole.
# - DDP: `ModelEMA` as is; FSDP2: `ShardedModelEMA` keeps the local shards. No collective in `update()`.
# - BatchNorm's buffers differ by rank: `ema.sync_buffers()` on every rank before evaluating or saving.
# - FSDP2 splits rows like `torch.chunk`, so a rank can hold an empty shard.

# %% [markdown]
# ## Exercises
#
# Try each exercise in the empty cell below it before you open its solution; to run a solution, paste it into that cell.
#
# **Exercise 1.** Without running the script, work out the EMA bytes each of 3 ranks holds under
# FSDP2: split the first dimension of each entry of the script's `make_model()` like `torch.chunk`,
# keep the BatchNorm's buffers, the int64 `num_batches_tracked` included, whole on every rank.
# *Predict* which rank holds the most.

# %%
# Exercise 1: your code here

# %% [markdown]
# <details><summary>Solution 1</summary>
#
# ```python
# from torch import nn
#
# layers = [nn.Linear(16, 64), nn.BatchNorm1d(64), nn.SiLU(), nn.Linear(64, 5), nn.SiLU(), nn.Linear(5, 3)]
# model3 = nn.Sequential(*layers)  # the script's make_model()
# buffers, per_rank = dict(model3.named_buffers()), [0, 0, 0]
# for name, t in model3.state_dict().items():
#     pieces = [t] * 3 if name in buffers else t.chunk(3)  # buffers whole on every rank; rows like chunk
#     for rank, piece in enumerate(pieces):
#         per_rank[rank] += piece.nbytes
# print(per_rank)
# ```
#
# Ranks 0 and 1 hold the most and the same: 64 rows split 22/22/20, 5 rows 2/2/1, 3 rows 1/1/1, so
# rank 2 gets fewer rows. `torchrun(3, workdir / "train_ema.py")` prints the same bytes.
#
# </details>

# %% [markdown]
# **Exercise 2.** Section 1 gave both shards the same decay. A rank that resumed from an older
# checkpoint counts fewer updates, so its ramp gives it a smaller decay. Update rank 0's rows with
# `d = 0.9` and rank 1's with `0.8`. *Predict* whether `torch.cat` of the shards equals the whole
# tensor's update with either decay.

# %%
# Exercise 2: your code here

# %% [markdown]
# <details><summary>Solution 2</summary>
#
# ```python
# shards2 = [piece.clone() for piece in ema_w.chunk(2)]
# for shard, target, decay in zip(shards2, model_w.chunk(2), (0.9, 0.8)):
#     shard.lerp_(target, 1 - decay)
# for decay in (0.9, 0.8):
#     print(decay, torch.equal(torch.cat(shards2), ema_w.clone().lerp_(model_w, 1 - decay)))
# ```
#
# `False` for both: the rows moved by two decays, so the gathered tensor is no EMA of the whole. The
# ranks must agree on the update count (`ema.updates`), for example by loading one checkpoint.
#
# </details>

# %% [markdown]
# **Exercise 3.** Count with `CommDebugMode` (from `torch.distributed.tensor.debug`) the collectives of
# `ema.update(model)`, of `ema.sync_buffers()` and of one `dist.all_reduce(torch.ones(3))`, for a
# `ModelEMA` of `nn.BatchNorm1d(4)`. A one-rank group is enough: start it with
# `dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)` and end it with
# `dist.destroy_process_group()`. *Predict* the three counts.

# %%
# Exercise 3: your code here

# %% [markdown]
# <details><summary>Solution 3</summary>
#
# ```python
# import torch.distributed as dist
# from torch.distributed.tensor.debug import CommDebugMode
#
# from ema_lab import ModelEMA
#
# dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# try:
#     bn = torch.nn.BatchNorm1d(4)
#     bn(torch.randn(8, 4))
#     bn_ema = ModelEMA(bn)
#     for name, call in [
#         ("ema.update()", lambda: bn_ema.update(bn)),
#         ("ema.sync_buffers()", bn_ema.sync_buffers),
#         ("dist.all_reduce", lambda: dist.all_reduce(torch.ones(3))),
#     ]:
#         with CommDebugMode() as comm:
#             call()
#         print(f"{name}: collectives {comm.get_total_counts()}")
# finally:
#     dist.destroy_process_group()
# ```
#
# 0, 0 and 1: the update reads only this rank's tensors, `sync_buffers()` has no one to send to, and an
# all-reduce is a collective even alone.
#
# </details>
