"""Shared by the threaded and the gloo ParallelStyle tests: the layer, the per-rank tokens, and
the comparison of a parallelized layer with the unsharded one."""

import threading

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_moe.nn import GroupedExperts, MoE, MoEConfig

# fp32; the parallel layers only reorder fp32 sums (combine, partial sums over F, reductions)
TOL = {"atol": 1e-6, "rtol": 1e-6}

# threaded ranks share torch's global generator: build modules one at a time
_INIT_LOCK = threading.Lock()


def make_moe(**overrides) -> MoE:
    """The same small layer on every rank."""
    cfg = dict(dim=8, hidden_dim=12, num_experts=8, top_k=2)
    cfg.update(overrides)
    with _INIT_LOCK:
        torch.manual_seed(0)
        return MoE(MoEConfig(**cfg))


def global_tokens(num_ranks: int, dim: int = 8):
    """``(x, grad_y)`` per rank, ``[T_r, D]`` with T_r = 5 + r (uneven), same on every rank."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5 + r, dim, generator=g) for r in range(num_ranks)]
    gs = [torch.randn(5 + r, dim, generator=g) for r in range(num_ranks)]
    return xs, gs


def compare_with_layer(test, model, ref, tokens_of, token_ids, dp_group):
    """Runs ``model`` on this rank's tokens ``tokens_of(rank)`` and ``ref`` on the token sets
    ``token_ids`` (concatenated); compares output, x.grad and every parameter gradient.

    Parameter gradients follow the data-parallel convention of DDP and FSDP: each rank
    backpropagates the loss of its own tokens, and a parameter's gradient is the *mean* over
    the ``N = len(token_ids)`` data-parallel token sets of their gradients, i.e. the unsharded
    layer's gradient on all of them divided by N. Expert gradients must be DTensors placed like
    their weights and are that mean after ``full_tensor()``; the other gradients are this
    rank's own, averaged here over ``dp_group`` as DDP would (None: already averaged by FSDP,
    or N = 1)."""
    xs, gs = global_tokens(test.world_size)
    me = tokens_of(test.rank)
    x = xs[me].clone().requires_grad_()
    y = model(x)
    y.backward(gs[me])

    ref_x = torch.cat([xs[i] for i in token_ids]).requires_grad_()
    ref_y = ref(ref_x)
    ref_y.backward(torch.cat([gs[i] for i in token_ids]))
    start = sum(xs[i].size(0) for i in token_ids[: token_ids.index(me)])
    mine = slice(start, start + x.size(0))
    num_token_sets = len(token_ids)

    test.assertEqual(y, ref_y[mine], **TOL)
    test.assertEqual(x.grad, ref_x.grad[mine], **TOL)
    ref_params = dict(ref.named_parameters())
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
               for p in m.parameters()}
    for name, p in model.named_parameters():
        grad = p.grad
        if id(p) in experts or isinstance(p, DTensor):
            test.assertIsInstance(grad, DTensor, msg=name)
            test.assertEqual(grad.placements, p.placements, msg=name)
            grad = grad.full_tensor()
        if id(p) not in experts and dp_group is not None:
            grad = grad.clone()
            dist.all_reduce(grad, group=dp_group)
            grad = grad / dist.get_world_size(dp_group)
        expected = ref_params[name].grad / num_token_sets
        # the ratio makes a gradient off by a data-parallel factor obvious in the failure
        test.assertEqual(grad, expected, **TOL,
                         msg=lambda m, name=name, grad=grad, expected=expected:
                         f"{name}: gradient / reference = "
                         f"{(grad.norm() / expected.norm()).item():.3f}\n{m}")
