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
# # 06 · The EMA when training spans many processes: DDP and FSDP2
#
# - An EMA update is elementwise, so it needs no communication between processes.
# - With DDP, `ModelEMA` works unchanged; with FSDP2, `ShardedModelEMA` keeps only each process's shard.
# - FSDP2 cuts rows like `torch.chunk`: processes can hold unequal shards, or none.

# %% tags=["nbval-ignore-output"]
import json
import os
import platform
import subprocess
import sys

import matplotlib.pyplot as plt
import torch

from ema_lab.lessons import scratch_dir
from ema_lab.lessons.distributed import loopback_interface, skip_reason

torch.set_num_threads(1)
print(
    f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.machine()}"
)
print(skip_reason() or "torch.distributed: everything the runs below need is here")

# %% [markdown]
# Training on several GPUs runs one process per GPU, called a *rank*. Each rank holds a full copy of
# the weights or, when the model is sharded, a slice of them. Can each rank keep an EMA of what it
# holds, without asking the others?

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
# ## 2. DDP and FSDP2
#
# A *collective* is an operation every rank must call together, such as an all-reduce (every rank ends
# with the sum of everyone's tensors).
#
# - **DDP** (`DistributedDataParallel`) keeps the full model on every rank and all-reduces the
#   gradients in backward. Every rank takes the same step, so `ModelEMA(ddp_model)` gives the same full
#   EMA on every rank, with no collective. It may live on rank 0 only.
# - **FSDP2** (`fully_shard`) keeps a row-slice (*shard*) of every parameter on each rank, as a DTensor:
#   a tensor from `torch.distributed.tensor` that knows it is one shard of a larger tensor. Full weights
#   exist only briefly, inside forward and backward. `ModelEMA` cannot deep-copy such a model and says
#   so.

# %% [markdown]
# ![FSDP2 splits 5 rows over 4 ranks as 2/2/1/0; each rank updates the EMA of its own rows](figures/06_fsdp_rows.svg)
#
# `ema_lab.ShardedModelEMA` is section 1's update, packaged: it copies each rank's local shards and
# updates them with one `_foreach_lerp_`, with no message to the other ranks.

# %% [markdown]
# ## 3. The training script
#
# One script trains a small MLP with DDP and `ModelEMA`, then with FSDP2 and `ShardedModelEMA`.
# `CommDebugMode` counts the collectives inside `ema.update()`. Rank 0 then trains the same model alone,
# in float64, on the whole batch, and checks both EMAs against it (a mismatch stops the script). It
# runs on the CPU over *gloo*, PyTorch's CPU communication backend (GPUs use `nccl`). `%%writefile`
# saves the cell to a temporary folder:

# %%
workdir = scratch_dir("ema_lab_06_")  # removed when the kernel stops, however it stops

# %% tags=["nbval-ignore-output"]
# %%writefile {workdir}/train_ema.py
"""Train one model with DDP + ModelEMA, then with FSDP2 + ShardedModelEMA; rank 0 checks both."""

import json
import os
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
    # DDP and FSDP2 leave references to the group inside torch, so its gloo threads outlive this call;
    # running on into Python's shutdown they were seen to abort a rank now and then: end here instead.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()


# %% [markdown]
# `torchrun` starts the ranks. Before they can talk, they need a *rendezvous*: an agreed address and
# port where they find each other; `--standalone` picks a free local one. torchrun passes it to
# `init_process_group` as `MASTER_ADDR` and `MASTER_PORT`, with `RANK` (this rank's number) and
# `WORLD_SIZE` (the number of ranks). The helper below runs it and prints what rank 0 printed. Each run
# starts fresh Python processes: expect up to 20 seconds on 2 cores.


# %%
def torchrun(nproc: int, *args: str) -> str:
    """Run train_ema.py in ``nproc`` processes over gloo; return rank 0's output, raise if a rank failed."""
    if skip_reason():
        return skip_reason()
    print(f"starting {nproc} ranks (up to 20 s) ...", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd.append(f"--log-dir={workdir / 'logs'}")  # torchrun's own logs, else a new temporary folder per run
    env = dict(os.environ)
    if loopback_interface():  # keep gloo on the loopback network interface (lo)
        env["GLOO_SOCKET_IFNAME"] = loopback_interface()
    proc = subprocess.run([*cmd, "train_ema.py", *args], cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stdout


# %% tags=["nbval-ignore-output"]
print(torchrun(2, "memory_2.json"))

# %% [markdown]
# Both EMAs match the one-process float64 EMA, with zero collectives in `update()`. `ModelEMA` refuses
# the sharded model with a `TypeError`. The 64 rows split 32/32, the 5 rows 3/2, the 3 rows 2/1.

# %% [markdown]
# ## 4. Uneven shards
#
# FSDP2 gives each rank `ceil(rows / world size)` rows until the rows run out, as in the picture of
# section 2. On four ranks (up to 20 s again):

# %% tags=["nbval-ignore-output"]
print(torchrun(4, "memory_4.json"))

# %% [markdown]
# 5 rows become 2/2/1/0 and 3 rows 1/1/1/0: rank 3 holds an *empty* shard, and its `_foreach_lerp_`
# simply has nothing to do there. The result still matches. `torch.chunk` shows the same split:

# %%
for rows, world in [(64, 3), (5, 4), (3, 4)]:
    sizes = [c.shape[0] for c in torch.empty(rows).chunk(world)]
    padded = sizes + [0] * (world - len(sizes))  # chunk returns fewer pieces; FSDP2 pads with empty shards
    print(f"{rows} rows over {world} ranks: {'/'.join(map(str, padded))}")

# %% [markdown]
# So 64 rows over 3 ranks are 22/22/20, not 22/21/21.

# %% [markdown]
# ## 5. Memory per rank
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
# DDP keeps a full EMA on every rank; the FSDP2 shards add up to one full EMA, and the ranks with the
# smaller or empty shards hold less.

# %% [markdown]
# ## 6. Saving and evaluating a sharded EMA
#
# `torch.distributed.checkpoint` (DCP) saves and loads sharded state, each rank writing its own part:
#
# ```python
# import torch.distributed.checkpoint as dcp
#
# dcp.save({"ema": ema.sharded_state_dict()}, checkpoint_id="ckpt/step_1000")  # no gathering
# full = ema.full_state_dict(cpu_offload=True)  # gathers to rank 0; call it on every rank
# ema.copy_to(eval_model)  # shard to shard, into an FSDP2 model sharded the same way
# ```
#
# Call `update()` after `optimizer.step()`. Between forward and backward FSDP2 may hold gathered
# tensors, and `ShardedModelEMA` then raises a `ValueError` rather than average the wrong ones.

# %% [markdown]
# ## Summary
#
# - The EMA update is elementwise: each rank averages the rows it owns, bit-identical to the whole.
# - DDP: `ModelEMA` as is, the same EMA on every rank, no collective.
# - FSDP2: `ShardedModelEMA` keeps the local shards, no collective in `update()`; DCP saves or gathers.
# - FSDP2 splits rows like `torch.chunk`, so a rank can hold an empty shard.

# %% [markdown]
# ## Exercises
#
# 1. Run the script on three ranks. How do the rows split, and which ranks hold the most EMA bytes?
# 2. In section 1, chunk a tensor of 7 rows into 3 pieces: is the result still bit-identical?
# 3. Count with `CommDebugMode` the collectives of `ema.update(model)` on a plain model, and of one
#    `dist.all_reduce` (a one-rank gloo group is enough).

# %% [markdown]
# ## Solutions
#
# Each solution cell is collapsed: click it to open.

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 1. 64 rows split 22/22/20, 5 rows 2/2/1, 3 rows 1/1/1; ranks 0 and 1 hold the most bytes.
print(torchrun(3))

# %% jupyter={"outputs_hidden": true, "source_hidden": true}
# 2. Yes: 3/3/1 rows, and lerp is still elementwise.
ema7, model7 = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
pieces = [p.clone() for p in ema7.chunk(3)]
torch._foreach_lerp_(pieces, list(model7.chunk(3)), 1 - d)
print([p.shape[0] for p in pieces], torch.equal(torch.cat(pieces), ema7.clone().lerp_(model7, 1 - d)))

# %% jupyter={"outputs_hidden": true, "source_hidden": true} tags=["nbval-ignore-output"]
# 3. The EMA update issues none; the all-reduce is one collective.
import torch.distributed as dist

from ema_lab import ModelEMA

if skip_reason():
    print(skip_reason())
else:
    from torch.distributed.tensor.debug import CommDebugMode

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.Linear(4, 4)
        net_ema = ModelEMA(net)
        with CommDebugMode() as comm:
            net_ema.update(net)
        print("ema.update():", comm.get_total_counts(), "collectives")
        with CommDebugMode() as comm:
            dist.all_reduce(torch.ones(3))
        print("dist.all_reduce:", comm.get_total_counts(), "collective")
    finally:
        dist.destroy_process_group()
