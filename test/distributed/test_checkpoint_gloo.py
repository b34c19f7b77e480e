# Owner(s): ["module: moe"]
"""Checkpoint resharding of expert weights and Adam state (``torch_moe.distributed.checkpoint``)
through real gloo process groups and ``torch.distributed.checkpoint`` on disk.

One test runs a chain of four stages, each in freshly spawned processes (4, then 2, then 1,
then 4), every stage loading the checkpoint of the previous one, checking it against the
single-process reference with ``torch.equal`` and saving a new one:

* contiguous expert parallelism: ``GroupedExperts`` weights as DTensors ``Shard(0)`` on the
  expert-parallel mesh, Adam after one step, through ``get_state_dict`` / ``set_state_dict``;
  a plain (non-DTensor) model at 1 rank;
* placement with replicas: local slot tensors under placement A (4 ranks, replicas of hot
  experts), placement B (2 ranks, other replicas, one expert twice on one rank), plain
  ``[E, ...]`` tensors at 1 rank, and placement A again. Stage 2 also reads the DTensor
  checkpoint of stage 1 into placement B's slots: both layouts store logical experts.

The ranks are started by a fork server that has imported torch once (a spawn per rank would
spend most of the test importing torch; forking the test process would inherit its state),
each stage on a free port,
with a deadline: a failing rank makes the test fail with its traceback, and the other ranks are
terminated instead of waiting in a collective.

Run: ``python -m pytest test/distributed/test_checkpoint_gloo.py -q`` from the repo root, or
``python test/distributed/test_checkpoint_gloo.py``.
"""

import os
import socket
import tempfile
import time
import traceback
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.testing._internal.common_utils import TestCase, run_tests

HAS_GLOO = dist.is_available() and dist.is_gloo_available()

# E = 8 experts; D * F = 128 so that every shard of every rank is a whole number of SIMD
# vectors and Adam's pointwise kernels round the same way as on the full tensors
E, D, F = 8, 8, 16
STAGE_TIMEOUT_S = 90
EXPERT_PARAMS = ("w1", "w2", "w3")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Net(nn.Module):
    """A router and one layer of routed experts: the parameter names of a real MoE block."""

    def __init__(self):
        super().__init__()
        from torch_moe.nn.modules.moe import GroupedExperts, MoEConfig

        self.router = nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts(MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=2))


def _reference():
    """Single-process parameters and Adam state after one step, as ``{name: tensor}`` and
    ``{name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}``."""
    torch.manual_seed(0)
    net = _Net()
    grads = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for n, p in net.named_parameters():
        p.grad = grads[n]
    opt.step()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()}
             for n, p in net.named_parameters()}
    return params, state, grads


def _placement_a():
    from torch_moe.distributed.placement import plan_placement

    # 4 ranks x 3 slots: 4 replicas go to the hot experts 2, 5 and 6
    return plan_placement(torch.tensor([5, 1, 40, 3, 2, 30, 20, 4]), num_ranks=4,
                          slots_per_rank=3)


def _placement_b():
    from torch_moe.distributed.placement import Placement

    # 2 ranks x 5 slots: expert 0 twice on rank 0, expert 3 on both ranks
    p2l = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 7])
    return Placement.from_phys_to_logical(p2l, num_ranks=2, num_logical=E)


def _logical_state(params, state):
    """The layout-2 state dict of logical tensors ``[E, ...]`` (and non-expert entries)."""
    out = {"router.weight": params["router.weight"], "step": state["experts.w1"]["step"]}
    for w in EXPERT_PARAMS:
        out[f"experts.{w}"] = params[f"experts.{w}"]
        out[f"optim.experts.{w}.exp_avg"] = state[f"experts.{w}"]["exp_avg"]
        out[f"optim.experts.{w}.exp_avg_sq"] = state[f"experts.{w}"]["exp_avg_sq"]
    return out


def _is_expert_key(key: str) -> bool:
    return key.startswith(("experts.", "optim.experts."))


def _local_slots(logical, placement, rank, fill):
    """This rank's state dict under ``placement``: the rows of its slots, or ``fill``ed."""
    S = placement.slots_per_rank
    slots = placement.phys_to_logical[rank * S:(rank + 1) * S]
    out = {}
    for k, v in logical.items():
        if _is_expert_key(k):
            out[k] = v[slots].clone() if fill is None else torch.full_like(v[slots], fill)
        else:
            out[k] = v.clone() if fill is None else torch.full_like(v, fill)
    return out


# ---------------------------------------------------------------------------------------------
# Layout 1: DTensor Shard(0) over the expert-parallel mesh (plain model at world size 1)
# ---------------------------------------------------------------------------------------------


def _ep_model(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard

    torch.manual_seed(1234)  # weights differ from the reference: loading must overwrite them
    net = _Net()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for w in EXPERT_PARAMS:
            p = getattr(net.experts, w)
            setattr(net.experts, w, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_ep(test, net, opt, params, state):
    from torch.distributed.tensor import DTensor, Shard

    for n, p in net.named_parameters():
        if n.startswith("experts.") and dist.get_world_size() > 1:
            test.assertIsInstance(p, DTensor)
            test.assertEqual(p.placements, (Shard(0),))
        test.assertTrue(torch.equal(_full(p.detach()), params[n]), n)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            test.assertTrue(torch.equal(_full(opt.state[p][k]), state[n][k]), f"{n}.{k}")


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


def _stage(stage: int, dirs: dict, test: TestCase) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor, DTensor

    from torch_moe.distributed.checkpoint import (
        load_expert_parallel_checkpoint,
        load_logical_expert_state_dict,
        logical_expert_state_dict,
        save_expert_parallel_checkpoint,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    params, state, grads = _reference()
    logical = _logical_state(params, state)

    # layout 1
    net, opt = _ep_model(world)
    if stage == 1:
        init = _reference_init()

        def like(p, full):
            if isinstance(p, DTensor):
                return distribute_tensor(full, p.device_mesh, p.placements)
            return full.clone()

        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(like(p, init[n]))
                p.grad = like(p, grads[n])
        opt.step()
    else:
        load_expert_parallel_checkpoint(net, opt, checkpoint_id=dirs[f"ep{stage - 1}"])
    _check_ep(test, net, opt, params, state)
    if stage < 4:
        save_expert_parallel_checkpoint(net, opt, checkpoint_id=dirs[f"ep{stage}"])

    # layout 2
    if stage == 3:  # one rank, plain logical tensors
        plain = {k: torch.zeros_like(v) for k, v in logical.items()}
        dcp.load(plain, checkpoint_id=dirs["pl2"])
        for k, v in logical.items():
            test.assertTrue(torch.equal(plain[k], v), k)
        dcp.save(plain, checkpoint_id=dirs["pl3"])
        return
    placement = _placement_b() if stage == 2 else _placement_a()
    if stage == 1:
        local = _local_slots(logical, placement, rank, fill=None)
    else:
        local = _local_slots(logical, placement, rank, fill=float("nan"))
        load_logical_expert_state_dict(local, placement, rank, _is_expert_key,
                                       checkpoint_id=dirs[f"pl{stage - 1}"])
    expected = _local_slots(logical, placement, rank, fill=None)
    for k, v in expected.items():
        test.assertTrue(torch.equal(local[k], v), k)
    if stage < 4:
        dcp.save(logical_expert_state_dict(local, placement, rank, _is_expert_key),
                 checkpoint_id=dirs[f"pl{stage}"])

    if stage == 2:
        # the DTensor Shard(0) checkpoint of stage 1 also holds logical experts
        keys = [f"model.experts.{w}" for w in EXPERT_PARAMS]
        S = placement.slots_per_rank
        slots = placement.phys_to_logical[rank * S:(rank + 1) * S]
        mine = {k: torch.full_like(params[k[len("model."):]][slots], float("nan")) for k in keys}
        load_logical_expert_state_dict(mine, placement, rank, keys, checkpoint_id=dirs["ep1"])
        for k in keys:
            test.assertTrue(torch.equal(mine[k], params[k[len("model."):]][slots]), k)


def _reference_init():
    """The reference parameters before the step (what stage 1 starts from)."""
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in _Net().named_parameters()}


def _worker(rank: int, world: int, port: int, stage: int, dirs: dict, errors) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=STAGE_TIMEOUT_S))
        try:
            _stage(stage, dirs, TestCase())
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((stage, rank, traceback.format_exc()))
        raise SystemExit(1)


def _context():
    # A fork server that has imported torch and this module once hands out fresh processes in
    # milliseconds: on two cores, a spawn per rank (11 of them) would spend most of the test
    # importing torch, and forking the test process itself would inherit its state (process
    # group, thread pools). The optimizer imports torch._dynamo on first use.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([
        "torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
        "torch_moe", "torch_moe.distributed.checkpoint", __name__,
    ])
    return ctx


@unittest.skipIf(not HAS_GLOO, "torch.distributed with the gloo backend is not available")
class TestCheckpointGloo(TestCase):
    def _run_stage(self, stage: int, world: int, dirs: dict) -> None:
        ctx = _context()
        errors = ctx.SimpleQueue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, stage, dirs, errors))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        failures = []

        def drain():
            # read as they come, so that no rank blocks on a full pipe
            while not errors.empty():
                failures.append("stage {} rank {}:\n{}".format(*errors.get()))

        try:
            # poll rather than join one by one: a failed rank must stop the stage at once,
            # not leave the others waiting in a collective
            while any(p.is_alive() for p in procs):
                drain()
                if failures or any(p.exitcode not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(10)
        drain()
        if failures:
            self.fail("\n".join(failures))
        codes = [p.exitcode for p in procs]
        if codes != [0] * world:
            self.fail(f"stage {stage} on {world} ranks: exit codes {codes} (timeout "
                      f"{STAGE_TIMEOUT_S} s or a crash without traceback)")

    def test_reshard_4_2_1_4(self):
        with tempfile.TemporaryDirectory() as tmp:
            dirs = {f"{layout}{s}": os.path.join(tmp, f"{layout}{s}")
                    for layout in ("ep", "pl") for s in (1, 2, 3)}
            for stage, world in ((1, 4), (2, 2), (3, 1), (4, 4)):
                self._run_stage(stage, world, dirs)


if __name__ == "__main__":
    run_tests()
