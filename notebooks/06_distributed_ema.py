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
# **Take-aways**
# - An EMA update is elementwise: it needs no communication, with DDP or with FSDP2.
# - With DDP, `ModelEMA` works unchanged (a full, identical copy per rank); with FSDP2 it cannot deep-copy
#   the model, and `ShardedModelEMA` keeps only each rank's shards, updated with one `_foreach_lerp_`.
# - FSDP2 cuts dim 0 like `torch.chunk`: ranks can hold unequal shards, or none at all.
#
# **Time** on this machine (2-core AMD EPYC, torch 2.13 CPU, shared with other jobs), measured with
# `time python3 dev.py notebooks notebooks/06_distributed_ema.py`: 52 s in full mode, 50 s in quick
# mode (`EMA_LAB_QUICK=1`) while other jobs loaded the machine, about 30-35 s when it was quiet. Both
# modes run the same processes; most of the time is starting them (each rank imports torch).

# %%
# NBVAL_IGNORE_OUTPUT
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ema_lab.bench.environment import format_environment
from ema_lab.lessons.distributed import loopback_interface, missing_apis

torch.set_num_threads(1)
print(format_environment())
print("torch.distributed APIs missing here:", missing_apis() or "none")

# %% [markdown]
# The cell above records the versions and hardware. Everything distributed below runs on the CPU with the
# gloo backend, so it needs no GPU.
#
# ## 1. An EMA is elementwise, so it shards
#
# One EMA step is `ema = lerp(ema, model, 1 - d)`: every element only looks at the same element of the
# model. FSDP2 splits each parameter along its first dimension into pieces, one per rank. So each rank
# can average *its* rows and never needs anyone else's. The cell splits a 5-row tensor into two pieces
# with `torch.chunk` (what FSDP2 does, section 4), updates the pieces with one `_foreach_lerp_`, and
# compares with the unsharded update.

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
# (`ema_lab.lessons.distributed.ddp_model_ema(model, rank0_only=True)`) saves the memory elsewhere and
# cannot deadlock (`tests/test_distributed.py` checks both).
#
# With FSDP2, `ModelEMA` cannot work the same way: it deep-copies the model, and a `fully_shard` module
# refuses to be deep-copied ("FSDP does not support deepcopy"), so `ModelEMA` checks for `FSDPModule`
# first and raises a `TypeError` that points to `ShardedModelEMA`. A full copy per rank would also
# defeat the point of sharding. `ShardedModelEMA` instead clones each parameter's local shard (a
# `DTensor` clones only its shard) into a module that holds them as `DTensor`s under the model's names,
# and updates the plain local tensors with the same validated strategies as `ModelEMA` (one
# `_foreach_lerp_` for a single-dtype model).
#
# ## 3. The training script
#
# Here is the whole thing as one script. On GPUs the same code would use the `nccl` backend, a
# `"cuda"` device mesh and the model on each rank's GPU; here it runs on the CPU. The cell writes it to a temporary folder with `%%writefile`. Each rank trains a small MLP
# on its slice of each global batch, first with DDP and `ModelEMA`, then with FSDP2 and
# `ShardedModelEMA`; `CommDebugMode` counts the collectives issued inside `ema.update()`. Rank 0 then
# trains the same model in one process, in float64, on the whole batch (the same averaged gradient)
# and checks both EMAs against it with `torch.testing.assert_close`: a mismatch fails the script.

# %%
# NBVAL_IGNORE_OUTPUT
workdir = Path(tempfile.mkdtemp(prefix="ema_lab_06_"))  # removed at the end of the notebook
print(workdir)

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/train_ema.py
"""Train one model with DDP + ModelEMA, then with FSDP2 + ShardedModelEMA; rank 0 checks both."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.parallel import DistributedDataParallel

from ema_lab import ModelEMA, ShardedModelEMA

STEPS, BATCH_PER_RANK, LR, DECAY, TAU = 6, 4, 0.1, 0.9, 2  # a short ramp: the EMA moves visibly


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """The same initial weights in every process; first dimensions 64, 5 and 3."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 5), nn.SiLU(), nn.Linear(5, 3)]
    return nn.Sequential(*layers).to(dtype)


def train(model: nn.Module, ema, part: slice, world: int, dtype=torch.float32) -> int:
    """SGD on this rank's part of each global batch, the EMA updated after every step.

    Returns how many collectives the EMA updates issued (CommDebugMode counts them).
    """
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    collectives = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)  # the same global batch in every process
        n = BATCH_PER_RANK * world
        x, y = torch.randn(n, 16, generator=g), torch.randn(n, 3, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[part].to(dtype)), y[part].to(dtype))
        loss.backward()  # DDP all-reduces, FSDP2 reduce-scatters: gradients averaged over ranks
        opt.step()
        with CommDebugMode() as comm:
            ema.update(model)  # local: no rank waits for another
        collectives += comm.get_total_counts()
    return collectives


def main() -> None:
    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    part = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    # DDP: every rank holds the whole model; ModelEMA unwraps .module and keeps a full copy.
    ddp = DistributedDataParallel(make_model())
    ddp_ema = ModelEMA(ddp, decay=DECAY, tau=TAU)
    ddp_comms = train(ddp, ddp_ema, part, world)

    # FSDP2: each rank holds a dim-0 shard of every parameter (a DTensor); the EMA keeps only those.
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
    fsdp_ema = ShardedModelEMA(model, decay=DECAY, tau=TAU)
    fsdp_comms = train(model, fsdp_ema, part, world)
    full = fsdp_ema.full_state_dict(cpu_offload=True)  # a collective: every rank calls it, rank 0 gets it

    mine = {
        "shard shapes": {k: list(t.shape) for k, t in fsdp_ema.local_tensors().items()},
        "FSDP2 EMA bytes": fsdp_ema.local_bytes(),
        "DDP EMA bytes": sum(t.numel() * t.element_size() for t in ddp_ema.ema.state_dict().values()),
        "collectives in update()": ddp_comms + fsdp_comms,
        "DDP EMA": ddp_ema.ema.state_dict(),
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)  # gather what each rank holds, to print it on rank 0
    if rank == 0:
        ref_model = make_model(torch.float64)  # one process, the whole batch, float64
        ref = ModelEMA(ref_model, decay=DECAY, tau=TAU)
        train(ref_model, ref, slice(None), world, torch.float64)
        want = {k: v.float() for k, v in ref.ema.state_dict().items()}
        for r in ranks:  # DDP: the same EMA on every rank, equal to one process
            torch.testing.assert_close(r["DDP EMA"], want)
        torch.testing.assert_close(full, want)  # FSDP2: the gathered shards, equal to one process
        print(f"world size {world}: DDP and FSDP2 EMAs equal the float64 one-process EMA (assert_close)")
        print(f"ModelEMA(fully_shard model) -> {refused}")
        print("FSDP2 shard rows per rank:")
        for k in ranks[0]["shard shapes"]:
            print(f"  {k:<9} {'/'.join(str(r['shard shapes'][k][0]) for r in ranks)} of {want[k].shape[0]}")
        for key in ("DDP EMA bytes", "FSDP2 EMA bytes", "collectives in update()"):
            print(f"{key + ' per rank:':<37} {[r[key] for r in ranks]}")
        summary = {k: [r[k] for r in ranks] for k in ("DDP EMA bytes", "FSDP2 EMA bytes")}
        if len(sys.argv) > 1:  # for the notebook's chart
            with open(sys.argv[1], "w") as f:
                json.dump(summary, f)
    dist.barrier()  # no rank tears its connections down while rank 0 still checks
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# %% [markdown]
# `torchrun --standalone --nproc-per-node 2 train_ema.py` starts two processes on this machine, which find
# each other through a rendezvous on a free local port and set `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
# `MASTER_PORT` for `init_process_group`. The cell runs the same launcher as
# `python -m torch.distributed.run` in a separate interpreter, pins gloo to the loopback interface, and
# prints what rank 0 printed (torchrun's own notices go to stderr, shown only if the run fails):


# %%
def torchrun(nproc: int, *args: str) -> str:
    """Run train_ema.py in ``nproc`` processes over gloo; return rank 0's output, raise if any rank failed."""
    if missing_apis():
        return f"skipped: this torch lacks {', '.join(missing_apis())}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = dict(os.environ)
    if loopback_interface():  # gloo binds the interface the hostname resolves to unless told otherwise
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    proc = subprocess.run([*cmd, "train_ema.py", *args], cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stdout


print(torchrun(2, "memory_2.json"))

# %% [markdown]
# What the run establishes:
#
# - **identical to one process**: on every rank, the DDP EMA matches the float64 one-process EMA to
#   float32 rounding (the all-reduce adds the two half-batch gradients in another order than one big
#   batch does), and so does the FSDP2 EMA gathered from the shards by `full_state_dict()`.
# - **no collective during `update()`**: zero on every rank, for DDP and FSDP2 together.
# - **`ModelEMA` refuses the `fully_shard` model** with a `TypeError` naming FSDP2.
# - **the shards**: at two ranks the 64 rows of `0.weight` split 32/32, the 5 rows of `2.weight` 3/2
#   and the 3 rows of `4.weight` 2/1: the first rank holds more when the rows do not divide evenly.
#
# `tests/test_distributed.py` checks the same properties on the zoo's tiny transformer, plus what this
# script does not show: the DDP EMA is bit-identical across ranks, an EMA kept on rank 0 only equals it,
# each FSDP2 update is exactly one `_foreach_lerp_` (counted with a `TorchDispatchMode`), and loading the
# sharded EMA into a second FSDP2 model with `copy_to` gives the same tensors.
#
# ## 4. Uneven shards: how FSDP2 cuts dim 0
#
# FSDP2 shards dim 0 with `torch.chunk`: every rank gets `ceil(rows / world)` rows until the rows run out.
# So the last ranks can hold fewer rows, or none. The same script on four ranks:

# %%
print(torchrun(4, "memory_4.json"))

# %% [markdown]
# 64 rows over 4 ranks are 16 each, but 5 rows become 2/2/1/0 and 3 rows 1/1/1/0: rank 3 holds an
# *empty* shard of those tensors (shape `(0, ...)`), still takes part in every collective, and its
# `_foreach_lerp_` simply has nothing to do for them. The result still matched the one-process EMA.
# `torch.chunk` itself returns fewer pieces than asked when the rows run out; FSDP2 pads the missing
# ranks with empty shards. On a plain tensor:

# %%
for rows, world in [(64, 3), (5, 4), (3, 4)]:
    sizes = [c.shape[0] for c in torch.empty(rows).chunk(world)]
    padded = sizes + [0] * (world - len(sizes))
    print(f"{rows} rows over {world} ranks: torch.chunk -> {sizes}; per rank -> {'/'.join(map(str, padded))}")

# %% [markdown]
# So 64 rows over 3 ranks are 22/22/20, not 22/21/21: the first ranks get `ceil(rows / world)` rows
# each and the last ones whatever is left, possibly nothing.
#
# ## 5. Memory per rank
#
# The point of the sharded EMA is memory. The bytes of EMA each rank held in the two runs above:

# %%
for world in (2, 4):
    path = workdir / f"memory_{world}.json"
    if path.exists():
        mem = json.loads(path.read_text())
        print(f"{world} ranks: DDP {mem['DDP EMA bytes']} B, FSDP2 {mem['FSDP2 EMA bytes']} B")

# %% [markdown]
# DDP keeps a full EMA (5,724 bytes here) on every rank; FSDP2 ranks hold their shards, which add up to
# one full EMA: 3,004 + 2,720 at two ranks, and at four ranks 1,632/1,632/1,372/1,088, where the
# smaller and empty shards make the last ranks lighter. The same numbers as a chart:

# %%
# NBVAL_IGNORE_OUTPUT
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for ax, world in zip(axes, (2, 4)):
    path = workdir / f"memory_{world}.json"
    if not path.exists():
        continue
    mem = json.loads(path.read_text())
    ranks = range(world)
    ax.bar([r - 0.2 for r in ranks], mem["DDP EMA bytes"], 0.4, label="DDP: ModelEMA")
    ax.bar([r + 0.2 for r in ranks], mem["FSDP2 EMA bytes"], 0.4, label="FSDP2: ShardedModelEMA")
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_title(f"{world} ranks")
axes[0].set_ylabel("EMA bytes on the rank")
axes[0].legend(fontsize=8)
fig.suptitle("EMA memory per rank, the script's MLP")
plt.show()

# %% [markdown]
# ## 6. Checkpointing and evaluating a sharded EMA
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
# 1. Run the script on three ranks. How many rows of each tensor does each rank hold, and which rank
#    holds the most EMA bytes?
# 2. In section 1, chunk a tensor of 7 rows into 3 pieces: is the result still bit-identical?
# 3. Wrap `ema.update(model)` of a plain model in `CommDebugMode`, then wrap a `dist.all_reduce` in it
#    too (a one-rank gloo group is enough): what does `get_total_counts()` say for each?
# 4. Why must `full_state_dict()` be called on *every* rank, even though only rank 0 receives the result?
#
# ## Solutions
#
# **1.** 64 rows split 22/22/20, 5 rows 2/2/1 and 3 rows 1/1/1; ranks 0 and 1 hold the most bytes.

# %%
print(torchrun(3))

# %% [markdown]
# **2.** Yes: 3/3/1 rows, and lerp is still elementwise.

# %%
ema7, model7 = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
pieces = [p.clone() for p in ema7.chunk(3)]
torch._foreach_lerp_(pieces, list(model7.chunk(3)), 1 - d)
print([p.shape[0] for p in pieces], torch.equal(torch.cat(pieces), ema7.clone().lerp_(model7, 1 - d)))

# %% [markdown]
# **3.** The EMA update issues none; the all-reduce is one collective.

# %%
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from ema_lab import ModelEMA

store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
try:
    net = torch.nn.Linear(4, 4)
    net_ema = ModelEMA(net)
    with CommDebugMode() as comm:
        net_ema.update(net)
    print("ema.update():", comm.get_total_counts(), "collectives")
    with CommDebugMode() as comm:
        dist.all_reduce(torch.ones(3))
    print("dist.all_reduce:", comm.get_total_counts(), "collective", dict(comm.get_comm_counts()))
finally:
    dist.destroy_process_group()

# %% [markdown]
# **4.** Gathering is a collective: every rank must send its shards. A rank that skips the call leaves
# the others waiting for it until the process group's timeout.
#
# ## Summary
#
# - The EMA update is elementwise, so it commutes with sharding: each rank averages the rows it owns and
#   the result is bit-identical to averaging the whole tensor.
# - DDP: `ModelEMA` on the DDP model works as is; every rank holds the same EMA, no collective is issued,
#   and the EMA may live on rank 0 only.
# - FSDP2: `ModelEMA` cannot deep-copy a `fully_shard` model; `ShardedModelEMA` keeps the local shards only,
#   updates them with one `_foreach_lerp_` and no communication, and gathers the full EMA with DCP's
#   `get_model_state_dict` when a checkpoint needs it.
# - FSDP2 cuts dim 0 like `torch.chunk` (`ceil(rows / world)` per rank until the rows run out): 64 rows
#   over 3 ranks are 22/22/20, 5 rows over 4 ranks 2/2/1/0, so a rank can hold an empty shard.
# - The script above ran in real gloo processes and matched a float64 one-process EMA;
#   `tests/test_distributed.py` checks the same on more properties and on four ranks.

# %%
shutil.rmtree(workdir)  # the temporary folder of section 3
