"""torch_moe in two minutes: train a small MoE language model, then benchmark the MoE layer.

The model is a pre-norm decoder: token embedding, causal self-attention
(``F.scaled_dot_product_attention``) and a :class:`torch_moe.nn.MoE` feed-forward block per
layer, a final RMSNorm and an LM head tied to the embedding. It learns a synthetic language:
sequences drawn from a fixed random sparse Markov chain, whose entropy rate is the best loss
any model can reach.

It is trained twice from the same initialisation on the same batches:

* ``bias on``:  ``MoEConfig(load_balance_bias=True)``, with ``moe.update_expert_bias()``
  called for every MoE layer before each ``optimizer.step()`` (DeepSeek-V3's
  auxiliary-loss-free balancing: the bias changes which experts are picked, not the weights);
* ``bias off``: the plain router, no auxiliary loss.

The log shows the loss, the throughput and how evenly the experts are loaded; the summary
compares the two runs. The demo ends with the layer benchmark on one shape
(``benchmarks/moe_layer.py --quick``).

With ``--expert-parallel``, under ``torchrun``, the model (bias on) is trained once with its
routed experts sharded over the ranks (EP = world size, gloo on CPU) by
:class:`torch_moe.distributed.parallel.ExpertParallel`. Every rank feeds its own batches; the
rest of the model is replicated and its gradients are averaged over the ranks. Rank 0 logs
the loss, the throughput of all ranks together, the dispatch traffic of rank 0 per step
(``torch_moe.distributed.dispatch.read_dispatch_counters()``) and the rows each rank's
experts received per step. ``--dedup`` and ``--num-chunks`` are passed to the dispatcher; the
layer benchmark is skipped.

Restarts: with ``--checkpoint-dir D --checkpoint-every K`` the expert-parallel run saves a DCP
checkpoint every K steps (:func:`torch_moe.distributed.checkpoint.atomic_checkpoint`: written
under a temporary name, committed by a rename) holding the model (expert weights as
``Shard(0)`` DTensors, the routers' expert bias), AdamW's state, the LR scheduler, the data
position (the step: every rank samples its sequences up front from a seeded generator and
takes the step's slice), every rank's torch CPU generator and the log so far. Started again
with the same D and the same settings, it resumes from the latest complete checkpoint, so a
job under ``torchrun --max-restarts N`` continues where it stopped, bit for bit: the final
parameters equal those of an uninterrupted run. ``--save-final PATH`` writes the full (gathered)
model and optimizer state from rank 0 with ``torch.save``. For tests of the restart path,
``--fail-at-step N --fail-rank R`` makes rank R exit with status 1 after step N (after its
checkpoint, if any), once: a marker file in D keeps the restarted run from failing again.
Replicas: ``--replicas N`` gives every rank ``N`` physical expert slots beyond ``ceil(E / R)``
(:class:`~torch_moe.distributed.parallel.ExpertParallel` with ``slots_per_rank``), which the
placement fills with replicas of the busiest experts; tokens go to the replicas of their
experts, the replica gradients are summed before every optimizer step
(:func:`torch_moe.distributed.replicas.reduce_replica_grads_`) and, with
``--rebalance-every K``, the placement is planned again every K steps from the loads observed
since the last time, the weights and AdamW's moments moving with it
(:func:`~torch_moe.distributed.replicas.rebalance_experts_`). The model is the same function of
its logical experts, so the losses are those of the run without replicas up to fp32 rounding:
the demo trains that run too, from the same initialisation on the same batches, and compares
the losses step by step. Rank 0 logs, at every rebalance, the max / mean rank load of each MoE
layer over the last K steps as measured under the placement in use, that of the same loads
under the new placement, and that of the contiguous layout without replicas.
``--router-skew s`` starts every router with a bias ``-s * log(1 + rank)`` over a random order
of the experts (a learned parameter from there on), a Zipf(s)-like preference for a few hot
experts, which is what replicas are for.

Run restarts with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun's default of one TCPStore
shared by every restart lets the new gloo group read the addresses of the dead one and fail or
hang in ``init_process_group`` (pytorch/pytorch#135712), in about half of the restarts here.

    python benchmarks/demo.py
    python benchmarks/demo.py --steps 100 --no-benchmark    # a shorter run
    torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 20
    torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --dedup --num-chunks 2
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 \
        benchmarks/demo.py --expert-parallel --steps 40 --checkpoint-dir /tmp/moe_ckpt \
        --checkpoint-every 10 --fail-at-step 25
    torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 40 --replicas 1 \
        --rebalance-every 10 --router-skew 1.2
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn, Tensor

from torch_moe.nn import MoE, MoEConfig

from _harness import destroy_process_group


# --------------------------------------------------------------------------
# Data: a fixed random sparse Markov chain
# --------------------------------------------------------------------------


def make_markov_chain(vocab: int, successors: int, seed: int) -> Tensor:
    """Transition matrix [V, V]: each token has ``successors`` possible next tokens, with
    random probabilities. Token t's successors are drawn near t + 1 (mod V) half the time,
    so that the chain is irreducible and the embedding has neighbourhoods to learn."""
    g = torch.Generator().manual_seed(seed)
    P_VV = torch.zeros(vocab, vocab)
    for t in range(vocab):
        nxt = torch.randperm(vocab, generator=g)[:successors]
        nxt[0] = (t + 1) % vocab  # a path through every token keeps the chain irreducible
        P_VV[t, nxt] = torch.rand(successors, generator=g) + 0.1
    return P_VV / P_VV.sum(dim=1, keepdim=True)


def entropy_rate(P_VV: Tensor) -> float:
    """Nats per token of the stationary chain: the loss floor of a perfect model."""
    pi_V = torch.full((P_VV.size(0),), 1.0 / P_VV.size(0), dtype=torch.float64)
    P = P_VV.double()
    for _ in range(1000):
        pi_V = pi_V @ P
    plogp_V = torch.where(P > 0, P * P.log(), torch.zeros_like(P)).sum(dim=1)
    return -(pi_V * plogp_V).sum().item()


def sample_sequences(P_VV: Tensor, num: int, length: int, seed: int) -> Tensor:
    """``num`` sequences of ``length`` tokens [num, length], each from a random start."""
    g = torch.Generator().manual_seed(seed)
    tokens_NL = torch.empty(num, length, dtype=torch.long)
    tokens_NL[:, 0] = torch.randint(P_VV.size(0), (num,), generator=g)
    for i in range(1, length):
        tokens_NL[:, i] = torch.multinomial(P_VV[tokens_NL[:, i - 1]], 1, generator=g).squeeze(1)
    return tokens_NL


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x_BLD: Tensor) -> Tensor:
        B, L, D = x_BLD.shape
        q, k, v = self.qkv(x_BLD).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y_BHLd = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y_BHLd.transpose(1, 2).reshape(B, L, D))


class Block(nn.Module):
    """Pre-norm transformer block whose feed-forward is an MoE layer."""

    def __init__(self, dim: int, heads: int, moe_config: MoEConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.moe_norm = nn.RMSNorm(dim)
        self.moe = MoE(moe_config)

    def forward(self, x_BLD: Tensor) -> Tensor:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        return x_BLD + self.moe(self.moe_norm(x_BLD))


class MoELanguageModel(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int,
                 moe_config: MoEConfig):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, moe_config) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    def forward(self, tokens_BL: Tensor) -> Tensor:
        x_BLD = self.embed(tokens_BL) + self.pos[: tokens_BL.size(1)]
        for block in self.blocks:
            x_BLD = block(x_BLD)
        return self.norm(x_BLD) @ self.embed.weight.t()  # tied LM head: logits [B, L, V]


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


@dataclass
class Window:
    """What happened over the last ``log_every`` steps."""

    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    counts_NE: Tensor | None = None  # routed assignments per (MoE layer, expert)

    def add(self, loss: float, seconds: float, counts_NE: Tensor) -> None:
        self.losses.append(loss)
        self.seconds += seconds
        self.counts_NE = counts_NE if self.counts_NE is None else self.counts_NE + counts_NE

    def imbalance(self) -> float:
        """Max over mean of the per-expert load, averaged over the MoE layers (1.0: even)."""
        return (self.counts_NE.max(dim=1).values / self.counts_NE.mean(dim=1)).mean().item()


def _collect_load(layers: list[MoE]) -> Tensor:
    """The step's per-expert assignments [num_layers, E]. Read before update_expert_bias(),
    which resets the counts it used."""
    return torch.stack([moe.tokens_per_expert.float() for moe in layers])


def train(args, balance: bool, train_NL: Tensor, label: str | None = None) -> dict:
    label = label or ("bias on " if balance else "bias off")
    moe_config = MoEConfig(dim=args.dim, hidden_dim=args.ffn_dim, num_experts=args.experts,
                           top_k=args.top_k, activation="swiglu", load_balance_bias=balance,
                           bias_update_rate=args.bias_update_rate, precision=args.precision)
    torch.manual_seed(args.seed)  # the same initial weights in both runs
    model = MoELanguageModel(args.vocab, args.dim, args.heads, args.layers, args.seq_len,
                             moe_config)
    layers = model.moe_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))

    history = dict(label=label, losses=[], imbalances=[], tokens_per_s=[])
    window = Window()
    order = torch.randperm(train_NL.size(0), generator=torch.Generator().manual_seed(args.seed))
    tokens_per_step = args.batch * (args.seq_len - 1)
    for step in range(1, args.steps + 1):
        rows = order[((step - 1) * args.batch + torch.arange(args.batch)) % train_NL.size(0)]
        batch_BL = train_NL[rows]
        start = time.perf_counter()
        logits_BLV = model(batch_BL[:, :-1])
        loss = F.cross_entropy(logits_BLV.flatten(0, 1), batch_BL[:, 1:].flatten())
        loss.backward()
        load_NE = _collect_load(layers)
        for moe in layers:
            if balance:
                moe.update_expert_bias()  # before optimizer.step(); resets tokens_per_expert
            else:
                moe.reset_load_stats()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        window.add(loss.item(), time.perf_counter() - start, load_NE)
        history["losses"].append(loss.item())

        if step % args.log_every == 0 or step == args.steps:
            n = len(window.losses)
            first_load_E = window.counts_NE[0] / window.counts_NE[0].sum()
            imbalance = window.imbalance()
            history["imbalances"].append(imbalance)
            history["tokens_per_s"].append(n * tokens_per_step / window.seconds)
            print(f"  [{label}] step {step:4d}  loss {sum(window.losses) / n:6.3f}  "
                  f"{history['tokens_per_s'][-1]:8,.0f} tok/s  layer-0 load "
                  + " ".join(f"{f:.2f}" for f in first_load_E.tolist())
                  + f"  imbalance {imbalance:5.2f}", flush=True)
            window = Window()
    if balance:
        history["bias"] = layers[0].router.expert_bias.clone()
    return history


# --------------------------------------------------------------------------
# Expert-parallel training (torchrun, gloo)
# --------------------------------------------------------------------------


# the settings a checkpoint must have been written with to be resumed: they define the data,
# the model and the optimization (--steps too: it sets how many sequences each rank samples)
RESUME_SETTINGS = ("steps", "batch", "seq_len", "vocab", "successors", "dim", "heads", "layers",
                   "ffn_dim", "experts", "top_k", "lr", "warmup_steps", "bias_update_rate",
                   "seed", "precision", "dedup", "num_chunks", "replicas", "rebalance_every",
                   "router_skew")


def _restart_state(args, step: int, history: dict, schedule, ep_mesh, model,
                   rebalance_NE: Tensor) -> dict:
    """What a restart needs besides the model (its parameters and the routers' expert bias, a
    persistent buffer) and the optimizer: the ``extra_state`` of the checkpoint.

    The MoE layers' ``tokens_per_expert`` counts are not in it: ``update_expert_bias`` resets
    them every step, before a checkpoint is written. The loop draws from no generator today
    (the data are sampled up front, nothing is dropped out); each rank's torch CPU generator is
    saved all the same, as one row of an ``[R, 5056]`` ``Shard(0)`` DTensor, so that adding
    dropout or router noise keeps restarts exact. State added later gets a key of its own here,
    e.g. the replicas': the placement tables of every replicated layer (their physical
    weights are ``Shard(0)`` DTensors laid out by them, saved like any other) and the loads
    observed since the last rebalance, which decide the next one.
    """
    from torch.distributed.tensor import DTensor, Shard

    from torch_moe.distributed.replicas import placement_state_dict

    replicas = ({"replicas": {"placement": placement_state_dict(model),
                              "loads_since_rebalance": rebalance_NE}}
                if args.replicas else {})
    return {
        **replicas,
        # the same on every rank: saved once
        "train": {"step": step, "world_size": ep_mesh.size(),
                  "settings": {k: getattr(args, k) for k in RESUME_SETTINGS},
                  "history": history},
        "scheduler": schedule.state_dict(),
        # one per rank
        "rng": {"cpu": DTensor.from_local(torch.get_rng_state().unsqueeze(0), ep_mesh,
                                          [Shard(0)])},
    }


def _resume(args, path: str, model, optimizer, schedule, ep_mesh, history: dict,
            rebalance_NE: Tensor) -> tuple[int, dict]:
    """Loads the checkpoint at ``path`` into the model, the optimizer, the scheduler, this
    rank's generator and, with replicas, the placements and ``rebalance_NE`` (in place);
    returns the step it was written after and the log up to it (``history``, the empty log,
    gives its keys)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torch_moe.distributed.checkpoint import load_expert_parallel_checkpoint

    from torch_moe.distributed.replicas import load_placement_state_dict_

    state = _restart_state(args, 0, history, schedule, ep_mesh, model, rebalance_NE)
    # the settings first: a checkpoint of another model would fail on its shapes instead
    train = {"train": state["train"]}
    dcp.load(train, checkpoint_id=path)
    saved_ranks, world_size = train["train"]["world_size"], dist.get_world_size()
    if saved_ranks != world_size:
        raise SystemExit(f"demo.py: {path} was written by {saved_ranks} ranks, this run has "
                         f"{world_size}: resuming needs the same number of ranks (each rank has "
                         f"its own data and generator)")
    settings = {k: getattr(args, k) for k in RESUME_SETTINGS}
    changed = {k: (v, settings.get(k)) for k, v in train["train"]["settings"].items()
               if settings.get(k) != v}
    if changed:
        raise SystemExit(f"demo.py: {path} was written with other settings, (saved, now): "
                         f"{changed}; resume with the same settings or another --checkpoint-dir")
    load_expert_parallel_checkpoint(model, optimizer, checkpoint_id=path, extra_state=state)
    schedule.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["cpu"].to_local()[0])
    if args.replicas:
        # the physical weights were read as they were saved, laid out by these placements
        load_placement_state_dict_(model, state["replicas"]["placement"])
    return state["train"]["step"], state["train"]["history"]


def _inject_fault(args, step: int, rank: int) -> None:
    """``--fail-at-step``: rank ``--fail-rank`` exits with status 1 after ``step``, the first
    time only (torchrun re-runs the same command when it restarts the group)."""
    if step != args.fail_at_step or rank != args.fail_rank:
        return
    marker = Path(args.checkpoint_dir) / f"fault_injected_step_{step}_rank_{rank}"
    if marker.exists():
        return
    with open(marker, "w") as f:
        f.write("demo.py --fail-at-step: this rank exited here once\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"  [fault injection] rank {rank} exits with status 1 after step {step}", flush=True)
    os._exit(1)  # no clean-up, no barrier: what a crashed process looks like to the others


def _skew_routers(layers: list[MoE], skew: float, seed: int) -> None:
    """``--router-skew``: router bias ``-skew * log(1 + rank)`` over a random expert order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for moe in layers:
            order = torch.randperm(moe.config.num_experts, generator=g).float()
            moe.router.bias.copy_(-skew * torch.log1p(order))


def _contiguous_imbalance(load_E: Tensor, num_ranks: int) -> float:
    """Max / mean rank load of ``load_E`` with experts in contiguous blocks, no replicas."""
    per_rank = load_E.double().view(num_ranks, -1).sum(1)
    return (per_rank.max() / per_rank.mean()).item()


def train_expert_parallel(args, P_VV: Tensor, replicas: int) -> dict:
    """Trains the model (expert-bias update on) with EP = world size, with ``replicas`` extra
    expert slots per rank; returns rank 0's history (every rank returns the same global
    losses). The run of ``--replicas`` is the job's: with ``--checkpoint-dir`` it resumes from
    the latest complete checkpoint there and saves one every ``--checkpoint-every`` steps, and
    ``--save-final`` and ``--fail-at-step`` apply to it; the run without replicas it is compared
    with does none of these."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_moe.distributed.checkpoint import (
        atomic_checkpoint,
        latest_checkpoint,
        save_expert_parallel_checkpoint,
    )
    from torch_moe.distributed.dispatch import read_dispatch_counters, reset_dispatch_counters
    from torch_moe.distributed.parallel import ExpertParallel
    from torch_moe.distributed.replicas import rebalance_experts_, reduce_replica_grads_

    rank, world_size = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    moe_config = MoEConfig(dim=args.dim, hidden_dim=args.ffn_dim, num_experts=args.experts,
                           top_k=args.top_k, activation="swiglu", load_balance_bias=True,
                           bias_update_rate=args.bias_update_rate, precision=args.precision,
                           router_bias=args.router_skew > 0)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = MoELanguageModel(args.vocab, args.dim, args.heads, args.layers, args.seq_len,
                             moe_config)
    layers = model.moe_layers()
    if args.router_skew > 0:
        _skew_routers(layers, args.router_skew, args.seed)
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    # with replicas: every rank ceil(E / R) + replicas physical slots, planned for an even load
    style = ExpertParallel(
        dispatch_options=dict(dedup=args.dedup, num_chunks=args.num_chunks),
        slots_per_rank=-(-args.experts // world_size) + replicas if replicas else None)
    for moe in layers:
        parallelize_module(moe, ep_mesh, style)  # w1/w2/w3 become Shard(0) DTensors
    # everything else (attention, norms, embedding, router) is replicated
    replicated = [p for p in model.parameters() if not isinstance(p, DTensor)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup_steps))

    # each rank its own sequences: a different sampling seed per rank, the same Markov chain
    train_NL = sample_sequences(P_VV, args.steps * args.batch, args.seq_len,
                                args.seed + 1 + 1000 * rank)
    tokens_per_step = world_size * args.batch * (args.seq_len - 1)  # all ranks together
    the_job = replicas == args.replicas
    checkpoint_dir = args.checkpoint_dir if the_job else None
    label = f"EP={world_size}" + (f", {replicas} replica slots per rank" if replicas else "")
    history = dict(label=label, losses=[], imbalances=[], tokens_per_s=[], rank_loads=[])
    # the global per-expert loads since the last rebalance, which plan the next one
    rebalance_NE = torch.zeros(len(layers), args.experts, dtype=torch.float64)
    done = 0  # steps already taken
    if checkpoint_dir is not None:
        found = latest_checkpoint(checkpoint_dir)  # rank 0 picks, every rank loads it
        if found is not None:
            done, history = _resume(args, found[1], model, optimizer, schedule, ep_mesh,
                                    history, rebalance_NE)
            if lead:
                restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                print(f"  [EP={world_size}] resuming from {found[1]}: {done} steps done "
                      f"(torchrun restart count {restarts})", flush=True)
        elif lead:
            print(f"  [EP={world_size}] no checkpoint in {checkpoint_dir}: starting at step 1",
                  flush=True)
    window = Window()
    traffic = torch.zeros(3, dtype=torch.float64)  # window sums: bytes sent, received, rows in
    for step in range(done + 1, args.steps + 1):
        batch_BL = train_NL[(step - 1) * args.batch: step * args.batch]
        reset_dispatch_counters()
        start = time.perf_counter()
        logits_BLV = model(batch_BL[:, :-1])
        loss = F.cross_entropy(logits_BLV.flatten(0, 1), batch_BL[:, 1:].flatten())
        # The objective is the mean of the per-rank losses. The expert weights (Shard(0)
        # DTensors) get the contributions of every rank's tokens through the all-to-all, which
        # ExpertParallel averages over the ranks: their gradients are already those of the
        # mean. The replicated parameters get only this rank's gradient: average them.
        loss.backward()
        grads = [p.grad for p in replicated if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # sum over the ranks, one collective for all of them
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g) / world_size)
        if replicas:
            # each replica has the gradient of its share of the expert's tokens: sum them, so
            # that every replica takes the logical expert's step
            reduce_replica_grads_(model)
        # the routers are replicated and so is their bias: update it from the global counts
        load_NE = _collect_load(layers)
        dist.all_reduce(load_NE)
        for moe, load_E in zip(layers, load_NE):
            moe.tokens_per_expert.copy_(load_E.long())
            moe.update_expert_bias()  # before optimizer.step(); resets tokens_per_expert
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        rebalance_NE += load_NE
        if replicas and args.rebalance_every and step % args.rebalance_every == 0:
            results = rebalance_experts_(layers, rebalance_NE, optimizer)
            history["rank_loads"].append(
                [(r.imbalance_before, r.imbalance_after, _contiguous_imbalance(l, world_size)
                  if args.experts % world_size == 0 else float("nan"))
                 for r, l in zip(results, rebalance_NE)])
            if lead:
                print(f"  [EP={world_size}] step {step:4d}  rebalance: max/mean rank load over "
                      f"the loads of the last {args.rebalance_every} steps on the placement in "
                      "use -> on the new one (contiguous, without replicas): " + "  ".join(
                          f"layer {i} {a:.3f} -> {b:.3f} ({c:.3f})"
                          for i, (a, b, c) in enumerate(history["rank_loads"][-1])),
                      flush=True)
            rebalance_NE.zero_()
        seconds = time.perf_counter() - start
        counters = read_dispatch_counters()  # this rank's, all MoE layers of the step
        traffic += torch.tensor([counters["bytes_sent"], counters["bytes_received"],
                                 counters["rows_received"]], dtype=torch.float64)
        window.add(loss.item(), seconds, load_NE)

        save = checkpoint_dir is not None and step % args.checkpoint_every == 0
        # a checkpoint ends a log window, so that the log it saves is complete
        if step % args.log_every == 0 or step == args.steps or save:
            n = len(window.losses)
            stats = torch.tensor([sum(window.losses), window.seconds], dtype=torch.float64)
            dist.all_reduce(stats)
            losses = torch.tensor(window.losses, dtype=torch.float64)
            dist.all_reduce(losses)  # per step: the sum of the rank losses
            history["losses"].extend((losses / world_size).tolist())
            # a tensor all_gather, not all_gather_object: the object collectives need NumPy
            gathered = [torch.empty_like(traffic) for _ in range(world_size)]
            dist.all_gather(gathered, traffic / n)
            per_rank = [t.tolist() for t in gathered]
            imbalance = window.imbalance()
            history["imbalances"].append(imbalance)
            # the slowest rank sets the pace; the mean of the ranks' times is close to it
            history["tokens_per_s"].append(n * tokens_per_step / (stats[1].item() / world_size))
            if lead:
                sent, received, _ = per_rank[0]
                print(f"  [EP={world_size}] step {step:4d}  loss "
                      f"{stats[0].item() / (n * world_size):6.3f}  "
                      f"{history['tokens_per_s'][-1]:8,.0f} tok/s  rank-0 bytes/step sent "
                      f"{sent:,.0f} received {received:,.0f}  rows received/step per rank "
                      + " ".join(f"{r[2]:,.0f}" for r in per_rank)
                      + f"  imbalance {imbalance:5.2f}", flush=True)
            window = Window()
            traffic.zero_()
        if save:
            with atomic_checkpoint(checkpoint_dir, step) as checkpoint_id:
                save_expert_parallel_checkpoint(
                    model, optimizer, checkpoint_id=checkpoint_id,
                    extra_state=_restart_state(args, step, history, schedule, ep_mesh, model,
                                               rebalance_NE))
            if lead:
                print(f"  [EP={world_size}] step {step:4d}  checkpoint committed in "
                      f"{checkpoint_dir}", flush=True)
        if args.fail_at_step is not None and the_job:
            _inject_fault(args, step, rank)

    if args.save_final is not None and the_job:
        from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions

        # full tensors gathered to rank 0 (the others get empty dicts)
        model_sd, optim_sd = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if lead:
            torch.save({"model": model_sd, "optim": optim_sd,
                        "scheduler": schedule.state_dict()}, args.save_final)
            print(f"  [EP={world_size}] final model and optimizer state saved to "
                  f"{args.save_final}", flush=True)
    return history


def _report_replicas(runs: list[dict], lead: bool) -> bool:
    """The replicated run against the one without replicas: the same losses up to fp32
    rounding (``1e-5`` of the loss, some hundred roundings of the sums that replicas reorder),
    and the max / mean rank loads at the rebalances."""
    replicated, plain = runs
    diffs = [abs(a - b) / abs(b) for a, b in zip(replicated["losses"], plain["losses"])]
    same = len(diffs) == len(plain["losses"]) and max(diffs) <= 1e-5
    if lead:
        print(f"  replicas: the largest relative loss difference to the run without replicas "
              f"over {len(diffs)} steps is {max(diffs):.2e}: "
              f"{'the same losses (within 1e-5)' if same else 'NOT the same losses'}")
        for i, layer_loads in enumerate(zip(*replicated["rank_loads"])):
            print(f"  layer {i} max/mean rank load at the rebalances (the loads since the "
                  "previous one on the placement in use -> on the new placement; contiguous "
                  "without replicas): " + ", ".join(f"{a:.3f} -> {b:.3f} ({c:.3f})"
                                                    for a, b, c in layer_loads))
    return same


def main_expert_parallel(args) -> int:
    import torch.distributed as dist

    start = time.perf_counter()
    dist.init_process_group("gloo")
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if args.experts % world_size != 0 and not args.replicas:
            raise SystemExit(f"demo.py --expert-parallel: --experts ({args.experts}) must be "
                             f"divisible by the number of ranks ({world_size}), or take "
                             "--replicas")
        if args.precision != "bf16":
            raise SystemExit("demo.py --expert-parallel: expert parallelism supports "
                             f"--precision bf16 only, got {args.precision}")
        if not 0 <= args.fail_rank < world_size:
            raise SystemExit(f"demo.py --expert-parallel: --fail-rank must be a rank in "
                             f"[0, {world_size}), got {args.fail_rank}")
        P_VV = make_markov_chain(args.vocab, args.successors, args.seed)
        floor = entropy_rate(P_VV)
        if rank == 0:
            print(f"torch {torch.__version__}, {world_size} ranks (gloo), "
                  f"{torch.get_num_threads()} threads each")
            print(f"model: {args.layers} pre-norm blocks, D={args.dim}, {args.heads} heads, MoE "
                  f"with E={args.experts} ({args.experts // world_size} per rank), k={args.top_k}, "
                  f"F={args.ffn_dim}, swiglu; AdamW lr {args.lr:g}; {args.steps} steps of "
                  f"{world_size} ranks x {args.batch} x {args.seq_len - 1} tokens; expert bias "
                  f"rate {args.bias_update_rate:g}; dispatch dedup={args.dedup}, "
                  f"num_chunks={args.num_chunks}; router skew {args.router_skew:g}")
            print(f"loss floor (entropy rate) {floor:.3f} nats, uniform guess "
                  f"{math.log(args.vocab):.3f}; loss = mean over the ranks; bytes = rank 0's "
                  "dispatch traffic over all MoE layers; imbalance = max/mean of the global "
                  "per-expert counts\n")
            if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
                    and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
                print("note: torchrun shares one TCPStore across restarts; a restarted group "
                      "can fail or hang in init_process_group (pytorch/pytorch#135712): set "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n")
            print(f"-- training with expert parallelism, EP={world_size}"
                  + (f", {args.replicas} replica slots per rank, rebalanced every "
                     f"{args.rebalance_every} steps" if args.replicas else ""))
        runs = [train_expert_parallel(args, P_VV, args.replicas)]
        if args.replicas and args.experts % world_size == 0:
            if rank == 0:
                print(f"\n-- the same without replicas, EP={world_size}")
            runs.append(train_expert_parallel(args, P_VV, 0))
        elif args.replicas and rank == 0:
            print(f"\n(no run without replicas to compare with: {args.experts} experts do not "
                  f"divide over {world_size} ranks)")
        loss_fell = all(_mean(h["losses"][-10:]) < h["losses"][0] for h in runs)
        same_losses = True
        if rank == 0:
            print("\n== summary")
            for h in runs:
                print(f"  [{h['label']}] loss {h['losses'][0]:.3f} -> "
                      f"{_mean(h['losses'][-10:]):.3f} (mean of the last 10 steps; entropy rate "
                      f"{floor:.3f}), {_mean(h['tokens_per_s']):,.0f} tok/s, mean imbalance "
                      f"{_mean(h['imbalances']):.2f}")
            print(f"  loss fell: {'yes' if loss_fell else 'NO'}")
        if len(runs) == 2:
            same_losses = _report_replicas(runs, rank == 0)
        if rank == 0:
            print(f"\ndemo done in {time.perf_counter() - start:.0f} s")
        return 0 if loss_fell and same_losses else 1
    finally:
        destroy_process_group()


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=65,
                    help="tokens per sequence (inputs: one fewer)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--successors", type=int, default=4,
                    help="next tokens possible after each token")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn-dim", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--bias-update-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8_rowwise", "mxfp8"),
                    help="expert GEMMs: unquantized ('bf16': the parameters' dtype, fp32 here), "
                    "or quantized on the fly (see benchmarks/quantization.py)")
    ap.add_argument("--no-benchmark", action="store_true", help="skip the layer benchmark")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="train once with the experts sharded over the ranks (EP = world size, "
                    "gloo); run under torchrun; no layer benchmark")
    ap.add_argument("--dedup", action="store_true",
                    help="expert parallel: one dispatched row per (token, destination rank)")
    ap.add_argument("--num-chunks", type=int, default=1,
                    help="expert parallel: chunks whose exchanges overlap the expert compute")
    ap.add_argument("--replicas", type=int, default=0,
                    help="expert parallel: physical expert slots per rank beyond ceil(E / R), "
                    "for replicas of the busiest experts")
    ap.add_argument("--rebalance-every", type=int, default=None,
                    help="expert parallel with --replicas: plan the placement again every this "
                    "many steps from the observed loads")
    ap.add_argument("--router-skew", type=float, default=0.0,
                    help="start the routers with a Zipf(s)-like bias towards a few experts")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="expert parallel: resume from the latest complete checkpoint here, and "
                    "save one every --checkpoint-every steps")
    ap.add_argument("--checkpoint-every", type=int, default=None,
                    help="expert parallel: steps between checkpoints (with --checkpoint-dir)")
    ap.add_argument("--save-final", default=None,
                    help="expert parallel: torch.save the full model and optimizer state here "
                    "(rank 0) at the end")
    ap.add_argument("--fail-at-step", type=int, default=None,
                    help="expert parallel, fault injection for restart tests: --fail-rank "
                    "exits with status 1 after this step, once (a marker in --checkpoint-dir)")
    ap.add_argument("--fail-rank", type=int, default=0,
                    help="the rank that --fail-at-step stops")
    args = ap.parse_args(argv)
    restart_flags = [f"--{k.replace('_', '-')}" for k in
                     ("checkpoint_dir", "checkpoint_every", "save_final", "fail_at_step")
                     if getattr(args, k) is not None]
    if restart_flags and not args.expert_parallel:
        ap.error(f"{', '.join(restart_flags)}: only with --expert-parallel")
    if args.replicas < 0:
        ap.error(f"--replicas must be at least 0, got {args.replicas}")
    if args.replicas and not args.expert_parallel:
        ap.error("--replicas: only with --expert-parallel")
    if args.rebalance_every is not None and (not args.replicas or args.rebalance_every < 1):
        ap.error(f"--rebalance-every needs --replicas and a number of steps >= 1, got "
                 f"{args.rebalance_every}")
    if args.router_skew < 0 or not math.isfinite(args.router_skew):
        ap.error(f"--router-skew must be a finite number >= 0, got {args.router_skew}")
    if (args.checkpoint_dir is None) != (args.checkpoint_every is None):
        ap.error("--checkpoint-dir and --checkpoint-every go together")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.fail_at_step is not None and (args.checkpoint_dir is None
                                          or not 1 <= args.fail_at_step <= args.steps):
        ap.error(f"--fail-at-step needs --checkpoint-dir and a step in [1, --steps], got "
                 f"{args.fail_at_step}")
    return args


def summarize(runs: list[dict], floor: float, skip_windows: int) -> bool:
    """Prints the comparison; returns whether both claims of the demo hold: the loss falls in
    both runs, and the expert-bias update lowers the imbalance."""
    print("\n== summary")
    for h in runs:
        losses = h["losses"]
        last = _mean(losses[-10:])
        print(f"  [{h['label']}] loss {losses[0]:.3f} -> {last:.3f} (mean of the last 10 steps; "
              f"entropy rate {floor:.3f}), {sum(h['tokens_per_s']) / len(h['tokens_per_s']):,.0f} "
              f"tok/s, mean imbalance {_mean(h['imbalances']):.2f} "
              f"(after the first window: {_mean(h['imbalances'][skip_windows:]):.2f})")
    on, off = runs
    print(f"  mean imbalance with the expert-bias update on: {_mean(on['imbalances']):.2f}, off: "
          f"{_mean(off['imbalances']):.2f} (max/mean expert load; 1.00 is perfectly even)")
    print("  layer-0 expert bias at the end: "
          + " ".join(f"{b:+.3f}" for b in on["bias"].tolist()))
    loss_fell = all(_mean(h["losses"][-10:]) < h["losses"][0] for h in runs)
    balanced = _mean(on["imbalances"]) < _mean(off["imbalances"])
    print(f"  loss fell in both runs: {'yes' if loss_fell else 'NO'}; the expert-bias update "
          f"lowered the imbalance: {'yes' if balanced else 'NO'}")
    return loss_fell and balanced


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.expert_parallel:
        return main_expert_parallel(args)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    P_VV = make_markov_chain(args.vocab, args.successors, args.seed)
    num_sequences = args.steps * args.batch  # every step sees new sequences
    train_NL = sample_sequences(P_VV, num_sequences, args.seq_len, args.seed + 1)
    floor = entropy_rate(P_VV)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"data: {num_sequences} sequences of {args.seq_len} tokens from a sparse Markov chain "
          f"over {args.vocab} tokens ({args.successors} successors each); loss floor (entropy "
          f"rate) {floor:.3f} nats, uniform guess {math.log(args.vocab):.3f}")
    print(f"model: {args.layers} pre-norm blocks, D={args.dim}, {args.heads} heads, MoE with "
          f"E={args.experts}, k={args.top_k}, F={args.ffn_dim}, swiglu, expert GEMMs "
          f"{args.precision}; AdamW lr {args.lr:g}; "
          f"{args.steps} steps of {args.batch} x {args.seq_len - 1} tokens; expert bias rate "
          f"{args.bias_update_rate:g}")
    print(f"imbalance = max/mean of the per-expert token counts over the last {args.log_every} "
          "steps, averaged over the MoE layers; layer-0 load = fraction of layer 0's assignments "
          "per expert\n")

    runs = []
    for balance in (True, False):
        print(f"-- training with the expert-bias update {'on' if balance else 'off'}")
        runs.append(train(args, balance, train_NL))
    ok = summarize(runs, floor, skip_windows=1)
    print(f"\ntraining took {time.perf_counter() - start:.0f} s")

    if not args.no_benchmark:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import moe_layer

        print("\n== the MoE layer on its own: python benchmarks/moe_layer.py --quick\n", flush=True)
        moe_layer.main(["--quick"])
    print(f"\ndemo done in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
