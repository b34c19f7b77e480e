# Owner(s): ["module: moe"]
"""Malformed calls of the expert-parallel dispatcher (``torch_moe.distributed.dispatch``) and of
the dispatch-plan functions (``torch_moe.distributed._dispatch_plan``).

A dispatcher case runs its call on the ranks of a threaded process group (one thread per rank,
real exchanges between them) and ends as rank 0 ended, after checking that every rank ended the
same way: every rank returned, or every rank raised the same exception type with the same
message, except where some ranks passed arguments that fail the local checks: those raise their
own messages and the others one that names them and carries their messages. A rank still waiting
when the others are done fails the case (a rank left in a collective).

Run: ``python -m pytest test/malformed/test_malformed_dispatch.py -q -p no:cacheprovider``.
"""

import math
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _malformed import Case, malformed_tests  # noqa: E402

import torch_moe  # noqa: F401,E402
from torch_moe.distributed._dispatch_plan import (  # noqa: E402
    bytes_per_token,
    dedup_mask,
    destination_ranks,
    expected_copies_per_token,
    rank_limited_topk,
    send_counts,
)
from torch_moe.distributed.dispatch import (  # noqa: E402
    expert_parallel_moe_ffn,
    read_dispatch_counters,
    reset_dispatch_counters,
)
from torch_moe.nn.functional import moe_ffn  # noqa: E402

EP = "torch_moe.distributed.dispatch.expert_parallel_moe_ffn"
PLAN = "torch_moe.distributed._dispatch_plan"

# the layer of every dispatcher case: 2 ranks, E = 4 experts (G = 2 per rank), D = F = 4
R, E, D, F = 2, 4, 4, 4
_JOIN_S = 12.0  # within the case's time limit


def on_ranks(fn, world_size: int = R):
    """Runs ``fn(rank)`` on ``world_size`` threads of a threaded process group.

    Returns the list of the ranks' results, or raises rank 0's exception when every rank raised
    the same one (type and message); anything else fails."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        _install_threaded_pg,
        ProcessLocalGroup,
    )
    from torch.distributed import distributed_c10d

    ended = [None] * world_size
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = _install_threaded_pg()
    store = dist.HashStore()

    def worker(rank):
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size,
                                store=store)
        try:
            ended[rank] = ("returned", fn(rank))
        except Exception as e:  # compared across the ranks below
            ended[rank] = ("raised", e)
        finally:
            if world == distributed_c10d._world:
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True)
               for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(_JOIN_S)
        waiting = [r for r, t in enumerate(threads) if t.is_alive()]
        if waiting:
            # release the waiting ranks, then clear the termination flag they share with the
            # cases that follow, so that those do not fail with this one
            ProcessLocalGroup.exception_handle(RuntimeError("a rank is still waiting"))
            for t in threads:
                t.join(_JOIN_S)
            ProcessLocalGroup.reset()
            raise AssertionError(f"ranks {waiting} are still waiting in a collective; the "
                                 f"others ended with {ended}")
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    kinds = {kind for kind, _ in ended}
    if kinds == {"returned"}:
        return [value for _, value in ended]
    if kinds != {"raised"} or len({type(e) for _, e in ended}) != 1:
        raise AssertionError(f"the ranks ended differently: {ended}")
    _check_messages([str(e) for _, e in ended])
    raise ended[0][1]


_FN = "expert_parallel_moe_ffn"
_BLAME = _FN + ": ranks "


def _check_messages(messages):
    """The same message on every rank, or: the ranks that failed their local checks their own
    messages, and every other rank the one that names them and carries those messages."""
    if len(set(messages)) == 1:
        return
    failing = [r for r, m in enumerate(messages) if not m.startswith(_BLAME)]
    blame = (f"{_BLAME}{failing} of the expert-parallel group passed invalid arguments; "
             + "; ".join(f"rank {r}: {messages[r].removeprefix(_FN + ': ')}" for r in failing))
    wrong = [r for r, m in enumerate(messages) if r not in failing and m != blame]
    if not failing or wrong:
        raise AssertionError(f"the ranks raised messages that do not match: {messages}")


def _global(T=3, k=2, seed=0, num_experts=E, dim=D):
    """Tokens of both ranks (T each), distinct top-k ids, weights and all experts' weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R * T, dim, generator=g)
    ids = (torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(R * T)])
           if T else torch.zeros(0, k, dtype=torch.int64))
    w = torch.rand(R * T, k, generator=g)
    w1 = torch.randn(num_experts, dim, F, generator=g) / dim**0.5
    w2 = torch.randn(num_experts, F, dim, generator=g) / F**0.5
    w3 = torch.randn(num_experts, dim, F, generator=g) / dim**0.5
    return x, ids, w, w1, w2, w3


def _rank_call(edit=None, T=3, k=2, num_experts=E, **options):
    """``run(rank)``: rank r passes its slice of :func:`_global`; ``edit(rank, args, options)``
    may change its positional arguments (a list) and keywords first."""
    def run(rank):
        x, ids, w, w1, w2, w3 = _global(T, k, num_experts=num_experts)
        G = num_experts // R
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        args = [x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts]]
        kw = dict(num_experts=num_experts, **options)
        if edit is not None:
            edit(rank, args, kw)
        return expert_parallel_moe_ffn(*args, **kw)

    return run


def _ep(edit=None, T=3, k=2, num_experts=E, **options):
    """A call on both ranks (see :func:`_rank_call`)."""
    return lambda: on_ranks(_rank_call(edit, T, k, num_experts, **options))


def _ep_then_a_good_call(edit, **options):
    """A call that ``edit`` spoils, then a good call on both ranks: the outputs of the latter."""
    spoiled, good = _rank_call(edit, **options), _rank_call()

    def run(rank):
        try:
            spoiled(rank)
        except (ValueError, TypeError):
            return good(rank)
        raise AssertionError("the spoiled call returned")

    return lambda: on_ranks(run)


def _set(index, value, ranks=None):
    """An ``edit`` that sets positional argument ``index`` to ``value(arg)`` on ``ranks``."""
    def edit(rank, args, kw):
        if ranks is None or rank in ranks:
            args[index] = value(args[index]) if callable(value) else value
    return edit


def _kw(ranks=None, **options):
    """An ``edit`` that sets keyword options on ``ranks`` (all when None)."""
    def edit(rank, args, kw):
        if ranks is None or rank in ranks:
            kw.update({k: (v(rank) if callable(v) else v) for k, v in options.items()})
    return edit


def _both(*edits):
    def edit(rank, args, kw):
        for e in edits:
            e(rank, args, kw)
    return edit


def _matches_moe_ffn(T=3, k=2, seed=0, edit_global=None, **options):
    """A check: every rank's output equals ``moe_ffn`` on the tokens of all ranks (NaN where it
    has NaN), with ``edit_global`` applied to the global data first."""
    def check(outs):
        data = list(_global(T, k, seed))
        if edit_global is not None:
            edit_global(data)
        ref = moe_ffn(*data)
        for rank, out in enumerate(outs):
            torch.testing.assert_close(out, ref[rank * T:(rank + 1) * T], atol=1e-6, rtol=1e-5,
                                       equal_nan=True)
    return check


def _ep_global(edit_global, T=3, k=2, **options):
    """A call on both ranks whose global data is changed by ``edit_global`` first."""
    def run(rank):
        data = list(_global(T, k))
        edit_global(data)
        x, ids, w, w1, w2, w3 = data
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * 2, (rank + 1) * 2)
        return expert_parallel_moe_ffn(x[mine], ids[mine], w[mine], w1[experts], w2[experts],
                                       w3[experts], num_experts=E, **options)

    return lambda: on_ranks(run)


def _zeros(T_of_rank):
    def check(outs):
        for rank, out in enumerate(outs):
            torch.testing.assert_close(out, torch.zeros(T_of_rank(rank), D))
    return check


def _nan_at(index):
    def edit(data):
        data[index] = data[index].clone()
        data[index][1, 0] = float("nan")
    return edit


def _repeat_first_id(data):
    data[1] = data[1].clone()
    data[1][:, 1] = data[1][:, 0]


_SAME = "expected every rank of the expert-parallel group to pass the same "
_BAD_ON_1 = "ranks [1] of the expert-parallel group passed invalid arguments; rank 1: "

EP_CASES = [
    # shapes of the tokens and the routing
    Case(EP, "x_1d", _ep(_set(0, lambda x: x[:, 0])), ValueError,
         ("x", "2-D [T, D]", "(3,)")),
    Case(EP, "x_3d", _ep(_set(0, lambda x: x[None])), ValueError, ("x", "2-D", "(1, 3, 4)")),
    Case(EP, "topk_ids_1d", _ep(_set(1, lambda t: t[:, 0])), ValueError,
         ("topk_ids", "topk_weights", "[T, k]", "(3,)", "(3, 2)")),
    Case(EP, "topk_weights_shape", _ep(_set(2, lambda t: t[:, :1])), ValueError,
         ("topk_ids", "topk_weights", "same shape", "(3, 2)", "(3, 1)")),
    Case(EP, "topk_ids_rows_differ_from_x",
         _ep(_both(_set(1, lambda t: t[:2]), _set(2, lambda t: t[:2]))), ValueError,
         ("topk_ids.size(0)", "x.size(0) = 3", "but got 2")),
    Case(EP, "k_zero", _ep(_both(_set(1, lambda t: t[:, :0]), _set(2, lambda t: t[:, :0]))),
         ValueError, ("top-k", "[1, num_experts = 4]", "but got 0")),
    Case(EP, "k_above_num_experts", _ep(_both(_set(1, lambda t: t.repeat(1, 3)),
                                              _set(2, lambda t: t.repeat(1, 3)))),
         ValueError, ("top-k", "[1, num_experts = 4]", "but got 6")),
    # dtypes
    Case(EP, "x_int", _ep(_set(0, lambda x: x.long())), ValueError, ("x.dtype", "torch.int64")),
    Case(EP, "x_complex", _ep(_set(0, lambda x: x.to(torch.complex64))), ValueError,
         ("x.dtype", "torch.complex64")),
    Case(EP, "topk_ids_float", _ep(_set(1, lambda t: t.float())), ValueError,
         ("integer topk_ids", "torch.float32")),
    Case(EP, "topk_ids_bool", _ep(_set(1, lambda t: t > 0)), ValueError,
         ("integer topk_ids", "torch.bool")),
    Case(EP, "topk_ids_complex", _ep(_set(1, lambda t: t.to(torch.complex64))), ValueError,
         ("integer topk_ids", "torch.complex64")),
    Case(EP, "topk_weights_int", _ep(_set(2, lambda t: (t * 10).long())), ValueError,
         ("floating topk_weights", "torch.int64")),
    Case(EP, "w1_other_dtype", _ep(_set(3, lambda t: t.double())), ValueError,
         ("w1_local", "torch.float32 like x", "torch.float64")),
    Case(EP, "w2_other_dtype", _ep(_set(4, lambda t: t.half())), ValueError,
         ("w2_local", "torch.float32 like x", "torch.float16")),
    # devices
    Case(EP, "topk_ids_on_meta", _ep(_set(1, lambda t: t.to("meta"))), ValueError,
         ("topk_ids", "device of x (cpu)", "meta")),
    Case(EP, "topk_weights_on_meta", _ep(_set(2, lambda t: t.to("meta"))), ValueError,
         ("topk_weights", "device of x (cpu)", "meta")),
    Case(EP, "w3_on_meta", _ep(_set(5, lambda t: t.to("meta"))), ValueError,
         ("w3_local", "on cpu", "meta")),
    # expert weights
    Case(EP, "w1_experts", _ep(_set(3, lambda t: t[:1])), ValueError,
         ("w1_local", "[2, 4, F]", "(1, 4, 4)")),
    Case(EP, "w2_dim", _ep(_set(4, lambda t: t[..., :3])), ValueError,
         ("w2_local", "[2, F, 4]", "(2, 4, 3)")),
    Case(EP, "w2_none", _ep(_set(4, None)), TypeError, ("w2_local", "Tensor", "None")),
    Case(EP, "w3_shape", _ep(_set(5, lambda t: t[..., :3])), ValueError,
         ("w3_local", "(2, 4, 4)", "(2, 4, 3)")),
    Case(EP, "w3_with_non_gated", _ep(activation="gelu"), ValueError,
         ("w3_local=None", "'gelu'", "(2, 4, 4)")),
    Case(EP, "fused_w1_without_w3", _ep(_set(5, None)), ValueError,
         ("w1_local.size(2)", "= 8", "2 * w2_local.size(1)", "but got 4")),
    # options
    Case(EP, "num_experts_not_divisible", _ep(_kw(num_experts=3)),
         ValueError, ("num_experts", "divisible by the 2 ranks", "num_experts=3")),
    Case(EP, "num_experts_zero", _ep(_kw(num_experts=0)), ValueError,
         ("num_experts", "positive int", "but got 0")),
    Case(EP, "num_experts_negative", _ep(_kw(num_experts=-4)), ValueError,
         ("num_experts", "positive int", "but got -4")),
    Case(EP, "num_experts_float", _ep(_kw(num_experts=4.0)), ValueError,
         ("num_experts", "positive int", "but got 4.0")),
    Case(EP, "num_experts_bool", _ep(_kw(num_experts=True)), ValueError,
         ("num_experts", "positive int", "but got True")),
    Case(EP, "num_experts_absurd", _ep(_kw(num_experts=2**62)), ValueError,
         ("w1_local", f"[{2**61}, 4, F]", "(2, 4, 4)")),
    Case(EP, "num_chunks_zero", _ep(num_chunks=0), ValueError,
         ("num_chunks", "[1, 16]", "but got 0")),
    Case(EP, "num_chunks_absurd", _ep(num_chunks=10**9), ValueError,
         ("num_chunks", "[1, 16]", "but got 1000000000")),
    Case(EP, "num_chunks_bool", _ep(num_chunks=True), ValueError,
         ("num_chunks", "[1, 16]", "but got True")),
    Case(EP, "num_chunks_float", _ep(num_chunks=2.0), ValueError,
         ("num_chunks", "[1, 16]", "but got 2.0")),
    Case(EP, "capacity_factor_zero", _ep(capacity_factor=0.0), ValueError,
         ("capacity_factor", "finite number > 0 or None", "but got 0.0")),
    Case(EP, "capacity_factor_negative", _ep(capacity_factor=-1), ValueError,
         ("capacity_factor", "> 0", "but got -1")),
    Case(EP, "capacity_factor_nan", _ep(capacity_factor=float("nan")), ValueError,
         ("capacity_factor", "finite", "but got nan")),
    Case(EP, "capacity_factor_inf", _ep(capacity_factor=float("inf")), ValueError,
         ("capacity_factor", "finite", "but got inf")),
    Case(EP, "capacity_factor_bool", _ep(capacity_factor=True), ValueError,
         ("capacity_factor", "finite number", "but got True")),
    Case(EP, "capacity_factor_str", _ep(capacity_factor="2"), ValueError,
         ("capacity_factor", "finite number", "but got '2'")),
    Case(EP, "dedup_not_bool", _ep(dedup="yes"), ValueError, ("dedup", "bool", "'yes'")),
    Case(EP, "activation_unknown", _ep(activation="tanh"), ValueError,
         ("activation", "swiglu", "'tanh'")),
    Case(EP, "alpha_nan", _ep(alpha=float("nan")), ValueError, ("alpha", "number", "nan")),
    # expert ids: only rank 1 is wrong; every rank raises the same error
    Case(EP, "id_equal_to_num_experts", _ep(_set(1, lambda t: t.fill_(E), ranks=(1,))),
         ValueError, ("expert ids", "[0, 4)", "ranks [1]")),
    Case(EP, "id_negative", _ep(_set(1, lambda t: t.fill_(-1), ranks=(1,))),
         ValueError, ("expert ids", "[0, 4)", "ranks [1]")),
    Case(EP, "id_out_of_range_capacity_mode",
         _ep(_set(1, lambda t: t.fill_(-1), ranks=(1,)), capacity_factor=2.0),
         RuntimeError, ("expert ids", "[0, 4)", "a rank of the expert-parallel group")),
    Case(EP, "id_repeated_overflowing_a_dedup_row",
         _ep(_set(1, lambda t: torch.tensor([[0, 0, 1]] * 3), ranks=(0,)), k=3, dedup=True),
         ValueError, ("distinct expert ids per token", "W = 2", "ranks [0]")),
    Case(EP, "id_repeated_overflowing_a_dedup_row_capacity_mode",
         _ep(_set(1, lambda t: torch.tensor([[0, 0, 1]] * 3), ranks=(0,)), k=3, dedup=True,
             capacity_factor=2.0),
         RuntimeError, ("distinct expert ids per token", "W = 2", "repeated an id")),
    # ranks that disagree on the layer: every rank raises the same error
    Case(EP, "ranks_disagree_num_chunks", _ep(_kw(num_chunks=lambda r: r + 1)), ValueError,
         (_SAME + "num_chunks", "1 on ranks [0]", "2 on ranks [1]")),
    Case(EP, "ranks_disagree_dedup", _ep(_kw(dedup=lambda r: r == 1)), ValueError,
         (_SAME + "dedup", "False on ranks [0]", "True on ranks [1]")),
    Case(EP, "ranks_disagree_capacity_factor", _ep(_kw(capacity_factor=lambda r: 1.0 + r)),
         ValueError, (_SAME + "capacity_factor", "1.0 on ranks [0]", "2.0 on ranks [1]")),
    Case(EP, "ranks_disagree_capacity_mode", _ep(_kw(capacity_factor=lambda r: r or None)),
         ValueError, (_SAME + "capacity_factor", "None on ranks [0]", "1.0 on ranks [1]")),
    Case(EP, "ranks_disagree_dim", _ep(_both(*(
        _set(i, f, ranks=(1,)) for i, f in ((0, lambda t: t[:, :3]), (3, lambda t: t[:, :3]),
                                            (4, lambda t: t[..., :3]), (5, lambda t: t[:, :3])))),
        capacity_factor=2.0),
        ValueError, (_SAME + "x.size(1)", "4 on ranks [0]", "3 on ranks [1]")),
    Case(EP, "ranks_disagree_dtype", _ep(_both(*(
        _set(i, lambda t: t.double(), ranks=(0,)) for i in (0, 3, 4, 5)))),
        ValueError, (_SAME + "x.dtype", "torch.float64 on ranks [0]", "torch.float32 on ranks [1]")),
    Case(EP, "ranks_disagree_activation", _ep(_both(
        _kw(activation=lambda r: "gelu" if r else "swiglu"), _set(5, None, ranks=(1,))),
        capacity_factor=2.0),
        ValueError, (_SAME + "activation", "'swiglu' on ranks [0]", "'gelu' on ranks [1]")),
    Case(EP, "ranks_disagree_num_experts", _ep(_both(
        _kw(num_experts=8, ranks=(1,)), *(_set(i, lambda t: torch.cat([t, t]), ranks=(1,))
                                           for i in (3, 4, 5)))),
        ValueError, (_SAME + "num_experts", "4 on ranks [0]", "8 on ranks [1]")),
    # arguments that fail the local checks on one rank only: that rank raises its own message,
    # every other rank one that names it (no rank is left waiting in the header's collective)
    Case(EP, "x_1d_on_one_rank", _ep(_set(0, lambda x: x[:, 0], ranks=(1,))), ValueError,
         (_BAD_ON_1 + "expected x to be 2-D [T, D]", "but got shape (3,)")),
    Case(EP, "x_1d_on_rank_0_only", _ep(_set(0, lambda x: x[:, 0], ranks=(0,))), ValueError,
         (_FN + ": expected x to be 2-D [T, D], but got shape (3,)",)),
    Case(EP, "x_list_on_one_rank", _ep(_set(0, lambda x: x.tolist(), ranks=(1,))), TypeError,
         (_BAD_ON_1, "expected x to be a Tensor", "but got list")),
    Case(EP, "x_int_on_one_rank", _ep(_set(0, lambda x: x.long(), ranks=(1,))), ValueError,
         (_BAD_ON_1, "x.dtype", "torch.float32", "but got torch.int64")),
    Case(EP, "x_complex_on_one_rank_capacity_mode",
         _ep(_set(0, lambda x: x.to(torch.complex64), ranks=(1,)), capacity_factor=2.0),
         ValueError, (_BAD_ON_1, "x.dtype", "but got torch.complex64")),
    Case(EP, "x_on_meta_on_one_rank", _ep(_set(0, lambda x: x.to("meta"), ranks=(1,))),
         ValueError, (_BAD_ON_1, "expected x on a device with data", "but got meta")),
    Case(EP, "every_tensor_on_meta_on_one_rank", _ep(_both(*(
        _set(i, lambda t: t.to("meta"), ranks=(1,)) for i in range(6)))),
        ValueError, (_BAD_ON_1, "expected x on a device with data", "but got meta")),
    Case(EP, "topk_ids_float_on_one_rank", _ep(_set(1, lambda t: t.float(), ranks=(1,))),
         ValueError, (_BAD_ON_1, "integer topk_ids", "torch.float32")),
    Case(EP, "topk_ids_bool_on_one_rank_capacity_mode",
         _ep(_set(1, lambda t: t > 0, ranks=(1,)), capacity_factor=2.0),
         ValueError, (_BAD_ON_1, "integer topk_ids", "torch.bool")),
    Case(EP, "topk_weights_shape_on_one_rank", _ep(_set(2, lambda t: t[:, :1], ranks=(1,))),
         ValueError, (_BAD_ON_1, "topk_ids and topk_weights of the same shape", "(3, 2)",
                      "(3, 1)")),
    Case(EP, "topk_weights_int_on_one_rank_dedup",
         _ep(_set(2, lambda t: (t * 10).long(), ranks=(1,)), dedup=True),
         ValueError, (_BAD_ON_1, "floating topk_weights", "torch.int64")),
    Case(EP, "k_above_num_experts_on_one_rank", _ep(_both(
        _set(1, lambda t: t.repeat(1, 3), ranks=(1,)), _set(2, lambda t: t.repeat(1, 3),
                                                            ranks=(1,)))),
        ValueError, (_BAD_ON_1, "top-k", "[1, num_experts = 4]", "but got 6")),
    Case(EP, "topk_ids_on_meta_on_one_rank", _ep(_set(1, lambda t: t.to("meta"), ranks=(1,))),
         ValueError, (_BAD_ON_1, "topk_ids", "device of x (cpu)", "meta")),
    Case(EP, "w1_experts_on_one_rank", _ep(_set(3, lambda t: t[:1], ranks=(1,))), ValueError,
         (_BAD_ON_1, "w1_local", "[2, 4, F]", "(1, 4, 4)")),
    Case(EP, "w2_none_on_one_rank", _ep(_set(4, None, ranks=(1,))), TypeError,
         (_BAD_ON_1, "w2_local", "Tensor", "None")),
    Case(EP, "w2_other_dtype_on_one_rank_capacity_mode",
         _ep(_set(4, lambda t: t.half(), ranks=(1,)), capacity_factor=2.0), ValueError,
         (_BAD_ON_1, "w2_local", "torch.float32 like x", "torch.float16")),
    Case(EP, "w3_with_non_gated_on_one_rank", _ep(_kw(activation="gelu", ranks=(1,))),
         ValueError, (_BAD_ON_1, "w3_local=None", "'gelu'", "(2, 4, 4)")),
    Case(EP, "num_experts_not_divisible_on_one_rank", _ep(_kw(num_experts=3, ranks=(1,))),
         ValueError, (_BAD_ON_1, "num_experts", "divisible by the 2 ranks", "num_experts=3")),
    Case(EP, "num_experts_zero_on_one_rank", _ep(_kw(num_experts=0, ranks=(1,))), ValueError,
         (_BAD_ON_1, "num_experts", "positive int", "but got 0")),
    Case(EP, "num_chunks_zero_on_one_rank", _ep(_kw(num_chunks=0, ranks=(1,))), ValueError,
         (_BAD_ON_1, "num_chunks", "[1, 16]", "but got 0")),
    Case(EP, "num_chunks_absurd_on_one_rank_capacity_mode",
         _ep(_kw(num_chunks=10**9, ranks=(1,)), capacity_factor=2.0), ValueError,
         (_BAD_ON_1, "num_chunks", "[1, 16]", "but got 1000000000")),
    Case(EP, "capacity_factor_nan_on_one_rank",
         _ep(_kw(capacity_factor=float("nan"), ranks=(1,)), capacity_factor=2.0), ValueError,
         (_BAD_ON_1, "capacity_factor", "finite number > 0 or None", "but got nan")),
    Case(EP, "capacity_factor_negative_on_one_rank", _ep(_kw(capacity_factor=-1.0, ranks=(1,))),
         ValueError, (_BAD_ON_1, "capacity_factor", "> 0", "but got -1.0")),
    Case(EP, "dedup_not_bool_on_one_rank", _ep(_kw(dedup=1, ranks=(1,))), ValueError,
         (_BAD_ON_1, "dedup", "bool", "but got 1")),
    Case(EP, "activation_unknown_on_one_rank_capacity_mode",
         _ep(_kw(activation="tanh", ranks=(1,)), capacity_factor=2.0, num_chunks=2),
         ValueError, (_BAD_ON_1, "activation", "swiglu", "'tanh'")),
    Case(EP, "alpha_nan_on_one_rank", _ep(_kw(alpha=float("nan"), ranks=(1,))), ValueError,
         (_BAD_ON_1, "alpha", "number", "but got nan")),
    Case(EP, "limit_str_on_one_rank", _ep(_kw(limit="7", ranks=(1,))), ValueError,
         (_BAD_ON_1, "limit", "number", "but got '7'")),
    # several ranks fail: each raises its own message, all with the type of the lowest one
    Case(EP, "every_rank_a_different_bad_num_chunks", _ep(_kw(num_chunks=lambda r: 17 + r)),
         ValueError, (_FN + ": expected num_chunks to be an int in [1, 16], but got 17",)),
    Case(EP, "ranks_failing_different_checks", _ep(_both(
        _set(4, None, ranks=(0,)), _set(0, lambda x: x[:, 0], ranks=(1,)))),
        TypeError, (_FN + ": expected w2_local to be a Tensor, but got None",)),
    Case(EP, "ranks_failing_different_checks_value_error_first", _ep(_both(
        _set(0, lambda x: x[:, 0], ranks=(0,)), _set(4, None, ranks=(1,)))),
        ValueError, (_FN + ": expected x to be 2-D [T, D], but got shape (3,)",)),
    # a bad argument on one rank is reported before bad ids on another
    Case(EP, "bad_ids_on_one_rank_bad_shape_on_the_other", _ep(_both(
        _set(1, lambda t: t.fill_(E), ranks=(0,)), _set(2, lambda t: t[:, :1], ranks=(1,)))),
        ValueError, (_BAD_ON_1, "topk_ids and topk_weights of the same shape", "(3, 1)")),
    Case(EP, "bad_option_on_one_rank_then_the_group_stays_in_step",
         _ep_then_a_good_call(_kw(num_chunks=0, ranks=(1,)), capacity_factor=2.0),
         check=_matches_moe_ffn()),
    Case(EP, "bad_shape_on_one_rank_then_the_group_stays_in_step",
         _ep_then_a_good_call(_set(0, lambda x: x[None], ranks=(0,))),
         check=_matches_moe_ffn()),
    # numbers too large for a float
    Case(EP, "capacity_factor_huge_int", _ep(capacity_factor=10**400), ValueError,
         ("capacity_factor", "finite number > 0 or None", "but got 1000000")),
    Case(EP, "alpha_huge_int", _ep(alpha=10**400), ValueError,
         ("alpha", "number", "but got 1000000")),
    # errors raised where they happen, without a collective: no group to exchange in
    Case(EP, "every_tensor_on_meta", _ep(_both(*(_set(i, lambda t: t.to("meta"))
                                                 for i in range(6)))),
         ValueError, ("expected x on a device with data", "but got meta")),
    Case(EP, "group_not_a_process_group", _ep(_kw(group="world")), TypeError,
         ("group", "ProcessGroup or None", "but got str")),
    Case(EP, "no_process_group", lambda: expert_parallel_moe_ffn(
        *_global()[:3], *(t[:2] for t in _global()[3:]), num_experts=E), ValueError,
        ("group=None", "default process group", "init_process_group")),
    # NaN / Inf: they stay in the tokens they belong to
    Case(EP, "nan_in_x", _ep_global(_nan_at(0)), check=_matches_moe_ffn(edit_global=_nan_at(0))),
    Case(EP, "nan_in_topk_weights_capacity_mode", _ep_global(_nan_at(2), capacity_factor=4.0),
         check=_matches_moe_ffn(edit_global=_nan_at(2))),
    # valid but unusual
    Case(EP, "no_tokens_anywhere", _ep(T=0), check=_zeros(lambda r: 0)),
    Case(EP, "no_tokens_anywhere_capacity_mode", _ep(T=0, capacity_factor=1.0, num_chunks=2),
         check=_zeros(lambda r: 0)),
    Case(EP, "no_tokens_on_rank_1_capacity_mode", _ep(
        _both(*(_set(i, lambda t: t[:0], ranks=(1,)) for i in (0, 1, 2))), capacity_factor=4.0,
        dedup=True), check=lambda outs: (
            torch.testing.assert_close(outs[0], moe_ffn(*_global())[:3], atol=1e-6, rtol=1e-5),
            torch.testing.assert_close(outs[1], torch.zeros(0, D)))),
    Case(EP, "repeated_ids_plain", _ep_global(_repeat_first_id),
         check=_matches_moe_ffn(edit_global=_repeat_first_id)),
    Case(EP, "repeated_ids_fitting_a_dedup_row", _ep_global(_repeat_first_id, dedup=True),
         check=_matches_moe_ffn(edit_global=_repeat_first_id)),
    Case(EP, "capacity_factor_absurd", _ep(capacity_factor=1e300, num_chunks=3),
         check=_matches_moe_ffn()),
    Case(EP, "more_chunks_than_tokens_capacity_mode", _ep(T=1, capacity_factor=2.0,
                                                          num_chunks=16),
         check=_matches_moe_ffn(T=1)),
]


def _expect(predicate, what):
    """A check that ``predicate(result)`` holds."""
    def check(result):
        if not predicate(result):
            raise AssertionError(f"expected {what}, but got {result!r}")
    return check


def _counters_after_reset():
    reset_dispatch_counters()
    return read_dispatch_counters()


def _close(expected):
    return lambda got: torch.testing.assert_close(got, expected)


_IDS = torch.tensor([[0, 3], [1, 2]])

PLAN_CASES = [
    Case("torch_moe.distributed.dispatch.read_dispatch_counters", "after_reset",
         _counters_after_reset, check=_expect(lambda c: c == {}, "no counters after a reset")),
    Case(f"{PLAN}.destination_ranks", "ids_float", lambda: destination_ranks(_IDS.float(), 4, 2),
         ValueError, ("topk_ids", "integer tensor", "torch.float32")),
    Case(f"{PLAN}.destination_ranks", "ids_bool", lambda: destination_ranks(_IDS > 0, 4, 2),
         ValueError, ("topk_ids", "integer tensor", "torch.bool")),
    Case(f"{PLAN}.destination_ranks", "ids_complex",
         lambda: destination_ranks(_IDS.to(torch.complex64), 4, 2),
         ValueError, ("topk_ids", "integer tensor", "torch.complex64")),
    Case(f"{PLAN}.destination_ranks", "ids_1d", lambda: destination_ranks(_IDS[0], 4, 2),
         ValueError, ("topk_ids", "2-D [T, k]", "(2,)")),
    Case(f"{PLAN}.destination_ranks", "ids_list", lambda: destination_ranks([[0, 1]], 4, 2),
         TypeError, ("topk_ids", "Tensor", "list")),
    Case(f"{PLAN}.destination_ranks", "not_divisible", lambda: destination_ranks(_IDS, 4, 3),
         ValueError, ("num_experts", "divisible by num_ranks=3", "num_experts=4")),
    Case(f"{PLAN}.destination_ranks", "num_ranks_zero", lambda: destination_ranks(_IDS, 4, 0),
         ValueError, ("num_ranks", "int >= 1", "but got 0")),
    Case(f"{PLAN}.destination_ranks", "num_experts_float",
         lambda: destination_ranks(_IDS, 4.0, 2),
         ValueError, ("num_experts", "int >= 1", "but got 4.0")),
    Case(f"{PLAN}.destination_ranks", "ids_out_of_range_not_validated",
         lambda: destination_ranks(torch.tensor([[-1, 4]]), 4, 2),
         check=_close(torch.tensor([[-1, 2]]))),  # documented: the range is not checked
    Case(f"{PLAN}.destination_ranks", "on_meta", lambda: destination_ranks(_IDS.to("meta"), 4, 2),
         check=_expect(lambda d: d.device.type == "meta" and d.shape == (2, 2),
                       "a [2, 2] meta tensor")),
    Case(f"{PLAN}.destination_ranks", "no_tokens",
         lambda: destination_ranks(torch.zeros(0, 2, dtype=torch.long), 4, 2),
         check=_close(torch.zeros(0, 2, dtype=torch.long))),
    Case(f"{PLAN}.dedup_mask", "dest_3d", lambda: dedup_mask(_IDS[None]), ValueError,
         ("dest", "2-D [T, k]", "(1, 2, 2)")),
    Case(f"{PLAN}.dedup_mask", "dest_float", lambda: dedup_mask(_IDS.float()), ValueError,
         ("dest", "integer tensor", "torch.float32")),
    Case(f"{PLAN}.dedup_mask", "repeated_ranks", lambda: dedup_mask(torch.tensor([[1, 1, 0]])),
         check=_close(torch.tensor([[True, False, True]]))),
    Case(f"{PLAN}.dedup_mask", "no_tokens", lambda: dedup_mask(torch.zeros(0, 3, dtype=torch.long)),
         check=_close(torch.zeros(0, 3, dtype=torch.bool))),
    Case(f"{PLAN}.send_counts", "ids_bool", lambda: send_counts(_IDS > 0, 4, 2, True), ValueError,
         ("topk_ids", "integer tensor", "torch.bool")),
    Case(f"{PLAN}.send_counts", "not_divisible", lambda: send_counts(_IDS, 6, 4, False),
         ValueError, ("num_experts", "divisible by num_ranks=4", "num_experts=6")),
    Case(f"{PLAN}.send_counts", "no_tokens",
         lambda: send_counts(torch.zeros(0, 2, dtype=torch.long), 4, 2, True),
         check=_close(torch.zeros(2, dtype=torch.long))),
    Case(f"{PLAN}.send_counts", "repeated_ids_dedup",
         lambda: send_counts(torch.tensor([[0, 0], [3, 2]]), 4, 2, True),
         check=_close(torch.tensor([1, 1]))),
    Case(f"{PLAN}.rank_limited_topk", "scores_int",
         lambda: rank_limited_topk(torch.ones(3, 8, dtype=torch.long), 2, 2, 1), ValueError,
         ("floating scores", "torch.int64")),
    Case(f"{PLAN}.rank_limited_topk", "scores_complex",
         lambda: rank_limited_topk(torch.ones(3, 8, dtype=torch.complex64), 2, 2, 1), ValueError,
         ("floating scores", "torch.complex64")),
    Case(f"{PLAN}.rank_limited_topk", "scores_1d", lambda: rank_limited_topk(torch.rand(8), 2, 2, 1),
         ValueError, ("scores", "2-D [T, E]", "(8,)")),
    Case(f"{PLAN}.rank_limited_topk", "k_zero", lambda: rank_limited_topk(torch.rand(3, 8), 0, 2, 1),
         ValueError, ("k", "int >= 1", "but got 0")),
    Case(f"{PLAN}.rank_limited_topk", "k_above_experts",
         lambda: rank_limited_topk(torch.rand(3, 8), 9, 2, 2),
         ValueError, ("k", "[1, num_experts=8]", "k=9")),
    Case(f"{PLAN}.rank_limited_topk", "k_above_kept_ranks",
         lambda: rank_limited_topk(torch.rand(3, 8), 5, 2, 1),
         ValueError, ("k", "max_ranks * experts per rank = 4", "k=5")),
    Case(f"{PLAN}.rank_limited_topk", "max_ranks_above_ranks",
         lambda: rank_limited_topk(torch.rand(3, 8), 2, 2, 3),
         ValueError, ("max_ranks", "[1, num_ranks=2]", "max_ranks=3")),
    Case(f"{PLAN}.rank_limited_topk", "rank_score_topk_bool",
         lambda: rank_limited_topk(torch.rand(3, 8), 2, 2, 1, rank_score_topk=True),
         ValueError, ("rank_score_topk", "int >= 1", "True")),
    Case(f"{PLAN}.rank_limited_topk", "rank_score_topk_above_experts",
         lambda: rank_limited_topk(torch.rand(3, 8), 2, 2, 1, rank_score_topk=5),
         ValueError, ("rank_score_topk", "[1, 4]", "rank_score_topk=5")),
    Case(f"{PLAN}.rank_limited_topk", "no_tokens",
         lambda: rank_limited_topk(torch.zeros(0, 8), 2, 2, 1),
         check=lambda out: (_close(torch.zeros(0, 2, dtype=torch.long))(out[0]),
                            _close(torch.zeros(0, 2))(out[1]))),
    Case(f"{PLAN}.rank_limited_topk", "nan_scores_kept_in_their_token",
         lambda: rank_limited_topk(torch.tensor([[0.1, 0.2, 0.3, 0.4], [float("nan")] * 4]), 1,
                                   2, 1),
         check=lambda out: _close(torch.tensor([[3]]))(out[0][:1])),
    Case(f"{PLAN}.expected_copies_per_token", "k_zero",
         lambda: expected_copies_per_token(8, 0, 2, True), ValueError,
         ("k", "int >= 1", "but got 0")),
    Case(f"{PLAN}.expected_copies_per_token", "k_above_experts",
         lambda: expected_copies_per_token(8, 9, 2, True), ValueError,
         ("k", "[1, num_experts=8]", "k=9")),
    Case(f"{PLAN}.expected_copies_per_token", "num_ranks_negative",
         lambda: expected_copies_per_token(8, 2, -2, True), ValueError,
         ("num_ranks", "int >= 1", "but got -2")),
    Case(f"{PLAN}.expected_copies_per_token", "max_ranks_zero",
         lambda: expected_copies_per_token(8, 2, 2, True, max_ranks=0), ValueError,
         ("max_ranks", "int >= 1", "but got 0")),
    Case(f"{PLAN}.expected_copies_per_token", "absurd_sizes_answer_fast",
         lambda: expected_copies_per_token(10**9, 10**6, 1000, True),
         check=_expect(lambda v: math.isclose(v, 1000.0), "1000.0"), timeout_s=5.0),
    Case(f"{PLAN}.expected_copies_per_token", "absurd_terms_raise",
         lambda: expected_copies_per_token(10**12, 2 * 10**6, 10**5, True), ValueError,
         ("min(k, num_experts / num_ranks)", "<= 1000000", "but got 2000000"), timeout_s=5.0),
    Case(f"{PLAN}.expected_copies_per_token", "every_rank_hit",
         lambda: expected_copies_per_token(8, 7, 2, True),
         check=_expect(lambda v: v == 2.0, "2.0 (every rank is hit)")),
    Case(f"{PLAN}.bytes_per_token", "dtype_bytes_nan",
         lambda: bytes_per_token(8, 2, 2, 16, float("nan"), True), ValueError,
         ("dtype_bytes", "finite number > 0", "nan")),
    Case(f"{PLAN}.bytes_per_token", "dtype_bytes_zero",
         lambda: bytes_per_token(8, 2, 2, 16, 0, True), ValueError,
         ("dtype_bytes", "finite number > 0", "but got 0")),
    Case(f"{PLAN}.bytes_per_token", "hidden_dim_float",
         lambda: bytes_per_token(8, 2, 2, 16.5, 2, True), ValueError,
         ("hidden_dim", "int >= 1", "16.5")),
]

CASES = EP_CASES + PLAN_CASES

TestMalformedDispatch = malformed_tests(CASES, "TestMalformedDispatch")

if __name__ == "__main__":
    run_tests()
