# Owner(s): ["module: moe"]
"""The Triton expert FFN (:mod:`torch_moe._triton.grouped_ffn`), forward and backward.

* Numerics (``TRITON_INTERPRET=1``, a subprocess per check): the kernel entries run on small CPU
  tensors and are compared with the CPU kernels of ``torch_moe::grouped_ffn`` /
  ``torch_moe::grouped_ffn_backward`` on the same values in fp32: every activation, gated with
  separate w1 / w3 and with a fused w13, ungated; bf16, fp16, fp32; routings with padding
  (``align=4``), empty experts, all tokens on one expert, no tokens, dropped assignments
  (``token_sort_with_capacity``); output_mask subsets; deterministic mode (which also NaN-fills
  fresh memory, so a row a kernel fails to write shows); sizes the tiles do not divide; fp64 for
  some kinds; dropped tokens holding NaN and an empty expert holding Inf, which nothing may read.

  Tolerances: ``hidden`` is one rounding of an fp32 GEMM. ``out`` and the gradients go through
  16-bit intermediates (the activation output, ``dH``, the gathered rows), so for bf16 / fp16
  they are compared with a few roundings of the largest magnitude as absolute tolerance. The
  backward reference is given the kernel's own ``hidden`` (upcast), so a clamp of swiglu_oai
  takes the same side in both.
* Tracing (no interpreter): the CUDA kernels of the public ops run on fake CUDA tensors and give
  the fake kernels' shapes, dtypes and strides (nothing is launched); AOT capture of the
  triton_ops and of the public ops on CUDA tensors holds functional Triton kernel wrappers, and
  the mutation analysis (with a stub sm_90 target) finds that each kernel writes its outputs
  only.
* :class:`TestTritonGroupedFFNDevice`: the same comparisons through the public ops at small
  realistic shapes, on a GPU only.
"""

import contextlib
import re

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import TestCase, run_tests

from _interpreter import (
    assert_matches,
    deterministic,
    patch_interpreter_bf16_dot,
    requires_triton,
    run_check,
    use_sm90_target,
)

GATED = ("swiglu", "geglu", "swiglu_oai")
ACTIVATIONS = GATED + ("gelu", "relu")
# a limit that the pre-activations cross on both sides, so the clamps of swiglu_oai engage
ALPHA, LIMIT = 1.702, 1.25
FULL_MASK = [True] * 8
# no gradients of the (absent) expert biases: output_mask entries 5..7
NO_BIASES = [False] * 3


# ---------------------------------------------------------------------------------------------
# Problems shared by the checks and the device tests
# ---------------------------------------------------------------------------------------------


def _routing(kind: str, T: int, k: int, E: int, generator, device="cpu"):
    """(sorted_ids, offs, topk_weights) of a routing of T tokens, built on CPU."""
    from torch_moe.nn.functional import token_sort_with_capacity

    topk_weights = torch.rand(T, k, generator=generator)
    if kind == "one expert":
        # expert 1 only (k = 1): the others are empty
        topk_ids = torch.ones(T, k, dtype=torch.int64)
    elif T == 0:
        topk_ids = torch.empty(0, k, dtype=torch.int64)
    else:
        # k distinct experts per token among the first E - 1: the last expert's group is empty
        topk_ids = torch.stack([torch.randperm(E - 1, generator=generator)[:k] for _ in range(T)])
    if kind == "dropped":
        sorted_ids, offs, _, _ = token_sort_with_capacity(topk_ids, topk_weights, E, 2, 1)
    else:
        align = 1 if kind == "dense" else 4
        sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(topk_ids, E, align)
    return sorted_ids.to(device), offs.to(device), topk_weights.to(device)


def _weights(activation: str, layout: str, E: int, D: int, F: int, generator):
    """(w1, w2, w3): w3 None for a fused w13 and for the ungated kinds."""
    def randn(*shape, fan_in):
        return torch.randn(shape, generator=generator) / fan_in**0.5

    w2 = randn(E, F, D, fan_in=F) * 2
    if activation not in GATED:
        return randn(E, D, F, fan_in=D) * 2, w2, None
    if layout == "fused":
        return randn(E, D, 2 * F, fan_in=D) * 2, w2, None
    return randn(E, D, F, fan_in=D) * 2, w2, randn(E, D, F, fan_in=D) * 2


def _cast(args, dtype, device=None):
    """Floating tensors to ``dtype``, all tensors to ``device``."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                a = a.to(dtype)
            if device is not None:
                a = a.to(device)
        out.append(a)
    return out


def _assert_close(actual, expected, what, rounded_intermediates=True):
    """``actual`` (a kernel output, in its dtype) against the fp32 CPU op.

    16-bit outputs computed from 16-bit intermediates (the activation output, dH) differ from
    the fp32 reference by a few roundings of the operands of their last GEMM: an absolute
    tolerance of a few units of the largest magnitude."""
    if actual.dtype in (torch.bfloat16, torch.float16) and rounded_intermediates:
        eps = 2.0**-8 if actual.dtype == torch.bfloat16 else 2.0**-11
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(
            actual.float(), expected.float(), rtol=4 * eps, atol=8 * eps * scale + 1e-5, msg=what
        )
    elif actual.dtype == torch.float32 and rounded_intermediates:
        # summation order: the kernels accumulate in tiles, the CPU kernel per group
        scale = expected.abs().max().item() if expected.numel() else 0.0
        torch.testing.assert_close(
            actual, expected.float(), rtol=1e-5, atol=2e-5 * max(1.0, scale), msg=what
        )
    else:
        assert_matches(actual, expected, what)


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compare_forward(fn, args, what):
    """Runs the forward ``fn(*args)`` against the CPU op on the fp32 (fp64) values."""
    dtype = args[0].dtype
    out, hidden = fn(*args)
    # every floating tensor, the biases after the scalars included
    ref_out, ref_hidden = torch.ops.torch_moe.grouped_ffn(
        *_cast(args, _reference_dtype(dtype), "cpu")
    )
    assert out.shape == ref_out.shape and out.dtype == dtype and out.is_contiguous(), what
    assert hidden.shape == ref_hidden.shape and hidden.dtype == dtype, what
    # hidden: one rounding of an fp32 GEMM
    _assert_close(hidden.cpu(), ref_hidden, f"{what}: hidden", rounded_intermediates=False)
    _assert_close(out.cpu(), ref_out, f"{what}: out")
    return hidden


def _compare_backward(fn, args, what):
    """Runs the backward ``fn(*args)`` against the CPU op on the fp32 (fp64) values, the empty
    outputs that output_mask asks for included."""
    got = fn(*args)
    ref = torch.ops.torch_moe.grouped_ffn_backward(
        *_cast(args, _reference_dtype(args[1].dtype), "cpu")
    )
    names = ("grad_x", "grad_topk_weights", "grad_w1", "grad_w2", "grad_w3", "grad_b1",
             "grad_b2", "grad_b3")
    assert len(got) == len(ref) == len(names), (what, len(got), len(ref))
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape, (what, name, g.shape, r.shape)
        assert g.is_contiguous(), (what, name)
        if g.numel():
            assert torch.isfinite(g).all(), (what, name)
            _assert_close(g.cpu(), r, f"{what}: {name}")


def _forward_args(x, routing, weights, activation):
    sorted_ids, offs, topk_weights = routing
    w1, w2, w3 = weights
    return [x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, ALPHA, LIMIT]


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------

T, K_TOP, E, D, F = 9, 2, 3, 32, 32
# (kind, T, k): no padding; one expert holding every token; capacity 2 (dropped assignments
# after offs[-1]); no tokens at all, padding only
ROUTINGS = (("dense", T, K_TOP), ("one expert", T, 1), ("dropped", 12, K_TOP), ("padded", 0, K_TOP))
# sizes that the tiles do not divide (masked K steps and columns), for the routing checks
D_ODD, F_ODD = 24, 40


def _configs():
    from torch_moe._triton.grouped_mm import GemmConfig

    # small: several row tiles per group, several column tiles of F (partial sums of the routing
    # gradient over them), several K steps; wide_k: one K step wider than D (masked loads)
    return {"small": GemmConfig(16, 16, 16), "wide_k": GemmConfig(16, 32, 64)}


def _small_config():
    return _configs()["small"]


def _layouts(activations=ACTIVATIONS):
    for activation in activations:
        for layout in ("separate", "fused") if activation in GATED else ("plain",):
            yield activation, layout


def _dtypes(activation: str):
    # fp64 (fp64 accumulation and epilogue) for the kinds with exp / erf in their formulas
    extra = (torch.float64,) if activation in ("swiglu_oai", "gelu") else ()
    return (torch.float32, torch.bfloat16, torch.float16) + extra


def _check_forward_activations() -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(0)
    routing = _routing("padded", T, K_TOP, E, g)
    x = torch.randn(T, D, generator=g)
    for activation, layout in _layouts():
        weights = _weights(activation, layout, E, D, F, g)
        for dtype in _dtypes(activation):
            args = _cast(_forward_args(x, routing, weights, activation), dtype)
            args[3] = routing[2]  # fp32 routing weights with 16-bit activations
            what = f"forward {activation} {layout} {dtype}"
            with deterministic():
                _compare_forward(lambda *a: M.grouped_ffn(*a, config=cfg), args, what)
    # the triton_op, default tiles, atomic combine
    for activation, layout in (("swiglu", "separate"), ("gelu", "plain")):
        args = _forward_args(x, routing, _weights(activation, layout, E, D, F, g), activation)
        _compare_forward(torch.ops.torch_moe._triton_grouped_ffn, args, f"triton_op {activation}")


def _check_forward_routings() -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfgs = _configs()
    g = torch.Generator().manual_seed(1)
    for kind, num_tokens, k in ROUTINGS:
        routing = _routing(kind, num_tokens, k, E, g)
        x = torch.randn(num_tokens, D_ODD, generator=g)
        for activation, layout in (("swiglu", "separate"), ("swiglu_oai", "fused"), ("relu", "")):
            weights = _weights(activation, layout, E, D_ODD, F_ODD, g)
            cases = ((torch.float32, False, "small"), (torch.bfloat16, True, "wide_k"))
            for dtype, in_order, config in cases:
                args = _cast(_forward_args(x, routing, weights, activation), dtype)
                what = (f"forward {kind} T={num_tokens} {activation} {dtype} {config} "
                        f"det={in_order}")
                with deterministic() if in_order else contextlib.nullcontext():
                    _compare_forward(
                        lambda *a: M.grouped_ffn(*a, config=cfgs[config]), args, what
                    )


def _backward_args(fwd_args, hidden, grad, mask):
    """The backward's arguments of the forward's (whose biases, if any, follow its scalars)."""
    x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit = fwd_args[:10]
    return [grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, activation, alpha,
            limit, mask, *fwd_args[10:]]


def _check_backward_activations(activations) -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(2)
    routing = _routing("padded", T, K_TOP, E, g)
    x = torch.randn(T, D, generator=g)
    grad = torch.randn(T, D, generator=g)
    for activation, layout in _layouts(activations):
        weights = _weights(activation, layout, E, D, F, g)
        for dtype in _dtypes(activation):
            args = _cast(_forward_args(x, routing, weights, activation), dtype)
            hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
            bargs = _backward_args(args, hidden, grad.to(dtype), FULL_MASK)
            what = f"backward {activation} {layout} {dtype}"
            with deterministic():
                _compare_backward(lambda *a: M.grouped_ffn_backward(*a, config=cfg), bargs, what)
    # the triton_op, default tiles, atomic scatter of grad_x
    activation = activations[0]
    layout = "separate" if activation in GATED else "plain"
    args = _forward_args(x, routing, _weights(activation, layout, E, D, F, g), activation)
    hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
    _compare_backward(
        torch.ops.torch_moe._triton_grouped_ffn_backward,
        _backward_args(args, hidden, grad, FULL_MASK), f"triton_op backward {activation}",
    )


def _check_backward_gated() -> None:
    _check_backward_activations(GATED)


def _check_backward_ungated() -> None:
    _check_backward_activations(("gelu", "relu"))


def _check_backward_routings() -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfgs = _configs()
    g = torch.Generator().manual_seed(3)
    for kind, num_tokens, k in ROUTINGS:
        routing = _routing(kind, num_tokens, k, E, g)
        x = torch.randn(num_tokens, D_ODD, generator=g)
        grad = torch.randn(num_tokens, D_ODD, generator=g)
        for activation, layout in (("swiglu", "separate"), ("swiglu_oai", "fused"), ("gelu", "")):
            weights = _weights(activation, layout, E, D_ODD, F_ODD, g)
            args = _forward_args(x, routing, weights, activation)
            hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
            for in_order, config in ((False, "small"), (True, "wide_k")):
                with deterministic() if in_order else contextlib.nullcontext():
                    what = f"backward {kind} T={num_tokens} {activation} {config} det={in_order}"
                    _compare_backward(
                        lambda *a: M.grouped_ffn_backward(*a, config=cfgs[config]),
                        _backward_args(args, hidden, grad, FULL_MASK), what,
                    )


def _check_backward_masks() -> None:
    """output_mask subsets, with separate w1 / w3 (grad_w3 its own output), bf16."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(4)
    masks = (
        [True, False, False, False, False] + NO_BIASES,
        [False, True, False, False, False] + NO_BIASES,
        [False, False, True, True, True] + NO_BIASES,
        [False, False, False, True, False] + NO_BIASES,
        [True, True, False, False, True] + NO_BIASES,
    )
    for kind, num_tokens, k in ROUTINGS:
        routing = _routing(kind, num_tokens, k, E, g)
        x = torch.randn(num_tokens, D_ODD, generator=g)
        grad = torch.randn(num_tokens, D_ODD, generator=g)
        weights = _weights("swiglu", "separate", E, D_ODD, F_ODD, g)
        args = _cast(_forward_args(x, routing, weights, "swiglu"), torch.bfloat16)
        hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
        for mask in masks:
            with deterministic():
                _compare_backward(
                    lambda *a: M.grouped_ffn_backward(*a, config=cfg),
                    _backward_args(args, hidden, grad.bfloat16(), mask),
                    f"backward {kind} T={num_tokens} mask={mask}",
                )


# (activation, layout, biases): each bias alone and all three with separate w1 / w3; the fused
# w13 with its [E, 2F] b1, alone and with b2 (swiglu_oai: the clamps engage); an ungated kind
BIAS_CASES = (
    ("swiglu", "separate", ("b1",)),
    ("swiglu", "separate", ("b2",)),
    ("swiglu", "separate", ("b3",)),
    ("swiglu", "separate", ("b1", "b2", "b3")),
    ("swiglu_oai", "fused", ("b1",)),
    ("swiglu_oai", "fused", ("b1", "b2")),
    ("relu", "plain", ("b1", "b2")),
)


def _bias_pairs(cases):
    """(bias case, routing index, case) triples: each bias case on two routings, each with one
    of the two ``cases`` (tile config, dtype, combine order), such that every routing meets
    both cases and both bias layouts (separate w1 / w3 and fused w13). A pairwise cover of the
    three axes rather than their product: each kernel run is seconds under the interpreter."""
    assert len(cases) == 2 and len(ROUTINGS) == 4
    for i, bias_case in enumerate(BIAS_CASES):
        for j, case in enumerate(cases):
            yield bias_case, (i + 2 * j) % len(ROUTINGS), case


def _biases(layout: str, names, E: int, D: int, F: int, generator) -> list:
    """[b1, b2, b3], None where not in ``names``: b1 ``[E, 2F]`` for a fused w13 (``[E, F]``
    otherwise), b2 ``[E, D]``, b3 ``[E, F]`` (a separate w3 only). Of the magnitude of the
    pre-activations, so the clamps of swiglu_oai engage with them too."""
    widths = {"b1": 2 * F if layout == "fused" else F, "b2": D, "b3": F}
    return [torch.randn(E, widths[n], generator=generator) if n in names else None
            for n in ("b1", "b2", "b3")]


def _bias_problem(routing, x, activation, layout, names, D_, F_, g):
    return (_forward_args(x, routing, _weights(activation, layout, E, D_, F_, g), activation)
            + _biases(layout, names, E, D_, F_, g))


def _check_forward_biases() -> None:
    """b1 / b3 in hidden, b2 scaled by the routing weight in out, against the CPU op: every
    routing (padding and an empty expert, one expert holding all tokens, dropped assignments,
    no tokens), sizes the tiles do not divide, fp32 and bf16, atomic and in-order combine."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfgs = _configs()
    g = torch.Generator().manual_seed(7)
    problems = [(kind, n, _routing(kind, n, k, E, g), torch.randn(n, D_ODD, generator=g))
                for kind, n, k in ROUTINGS]
    cases = ((torch.float32, False, "small"), (torch.bfloat16, True, "wide_k"))
    for (activation, layout, names), j, (dtype, in_order, config) in _bias_pairs(cases):
        kind, num_tokens, routing, x = problems[j]
        dargs = _cast(_bias_problem(routing, x, activation, layout, names, D_ODD, F_ODD, g),
                      dtype)
        what = (f"forward {kind} T={num_tokens} {activation} {layout} {names} {dtype} "
                f"{config} det={in_order}")
        with deterministic() if in_order else contextlib.nullcontext():
            _compare_forward(lambda *a: M.grouped_ffn(*a, config=cfgs[config]), dargs, what)
    # the triton_op, default tiles
    routing = _routing("padded", T, K_TOP, E, g)
    x = torch.randn(T, D, generator=g)
    args = _bias_problem(routing, x, "swiglu", "separate", ("b1", "b2", "b3"), D, F, g)
    _compare_forward(torch.ops.torch_moe._triton_grouped_ffn, args, "triton_op biases")


def _check_backward_biases() -> None:
    """grad_b1 / grad_b3 (row sums of dH per expert), grad_b2 (of the weighted output gradient)
    and the routing weights' gradient with its <grad, b2[e]> term, every gradient requested,
    against the CPU op, for every routing; an empty expert's bias gradients are zeros."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfgs = _configs()
    g = torch.Generator().manual_seed(8)
    problems = [(kind, n, _routing(kind, n, k, E, g), torch.randn(n, D_ODD, generator=g),
                 torch.randn(n, D_ODD, generator=g)) for kind, n, k in ROUTINGS]
    for (activation, layout, names), j, (in_order, config) in _bias_pairs(
            ((False, "small"), (True, "wide_k"))):
        kind, num_tokens, routing, x, grad = problems[j]
        args = _bias_problem(routing, x, activation, layout, names, D_ODD, F_ODD, g)
        hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
        what = (f"backward {kind} T={num_tokens} {activation} {layout} {names} {config} "
                f"det={in_order}")
        with deterministic() if in_order else contextlib.nullcontext():
            _compare_backward(lambda *a: M.grouped_ffn_backward(*a, config=cfgs[config]),
                              _backward_args(args, hidden, grad, FULL_MASK), what)
    # the triton_op, default tiles (and the default tiles of the bias sums)
    routing = _routing("padded", T, K_TOP, E, g)
    x, grad = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    args = _bias_problem(routing, x, "swiglu", "separate", ("b1", "b2", "b3"), D, F, g)
    hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
    _compare_backward(torch.ops.torch_moe._triton_grouped_ffn_backward,
                      _backward_args(args, hidden, grad, FULL_MASK), "triton_op backward biases")


def _check_backward_bias_masks() -> None:
    """output_mask subsets with biases, bf16: the bias gradients alone (dH computed for them
    only), the routing weights' gradient alone (its b2 term), each bias gradient on its own;
    and an FFN dim of zero, where out is the weighted b2 and no column tile carries the
    routing gradient's b2 term."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(9)
    off = [False] * 5
    masks = (
        off + [True, True, True],
        [False, True, False, False, False, False, False, False],
        off + [True, False, False],
        off + [False, True, False],
        off + [False, False, True],
        [True, True, False, False, False, False, True, False],
    )
    routing = _routing("padded", T, K_TOP, E, g)
    x = torch.randn(T, D_ODD, generator=g)
    grad = torch.randn(T, D_ODD, generator=g)
    for activation, layout in (("swiglu", "separate"), ("swiglu_oai", "fused")):
        names = ("b1", "b2", "b3") if layout == "separate" else ("b1", "b2")
        args = _cast(_bias_problem(routing, x, activation, layout, names, D_ODD, F_ODD, g),
                     torch.bfloat16)
        hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
        for mask in masks:
            with deterministic():
                _compare_backward(
                    lambda *a: M.grouped_ffn_backward(*a, config=cfg),
                    _backward_args(args, hidden, grad.bfloat16(), mask),
                    f"backward {activation} {layout} mask={mask}",
                )
    args = _bias_problem(routing, x, "swiglu", "separate", ("b1", "b2", "b3"), D_ODD, 0, g)
    hidden = _compare_forward(lambda *a: M.grouped_ffn(*a, config=cfg), args, "forward F=0")
    for mask in (FULL_MASK, masks[1]):
        _compare_backward(lambda *a: M.grouped_ffn_backward(*a, config=cfg),
                          _backward_args(args, hidden, grad, mask), f"backward F=0 mask={mask}")


def _check_dropped_reads_nothing() -> None:
    """Padding and dropped assignments read no row: the tokens whose assignments are all dropped
    (capacity 2 of 6, align 4) hold NaN in x and grad, the expert that gets nothing has Inf
    weights (and, in a second run, Inf biases); every output is finite and equals the CPU
    kernel on the same values."""
    from torch_moe.nn.functional import token_sort_with_capacity
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(5)
    n = 6
    topk_ids = torch.zeros(n, 1, dtype=torch.int64)
    # descending weights: tokens 2.. are dropped
    topk_weights = torch.linspace(1.0, 0.5, n).view(n, 1)
    sorted_ids, offs, _, _ = token_sort_with_capacity(topk_ids, topk_weights, 2, 2, 4)
    assert (sorted_ids >= 2).sum() == 0 and (sorted_ids < 0).any(), sorted_ids
    x = torch.randn(n, D, generator=g)
    grad = torch.randn(n, D, generator=g)
    x[2:] = float("nan")
    grad[2:] = float("nan")
    for activation, layout in (("swiglu", "separate"), ("geglu", "fused"), ("relu", "plain")):
        w1, w2, w3 = _weights(activation, layout, 2, D, F, g)
        for w in (w1, w2, w3):
            if w is not None:
                w[1] = float("inf")
        plain = [x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, ALPHA, LIMIT]
        biases = _biases(layout, ("b1", "b2", "b3") if layout == "separate" else ("b1", "b2"),
                         2, D, F, g)
        for b in biases:
            if b is not None:
                b[1] = float("inf")
        for args, in_order in ((plain, False), (plain, True), (plain + biases, False),
                               (plain + biases, True)):
            with deterministic() if in_order else contextlib.nullcontext():
                what = f"dropped {activation} biases={len(args) > 10} det={in_order}"
                out, hidden = M.grouped_ffn(*args, config=cfg)
                ref_out, ref_hidden = torch.ops.torch_moe.grouped_ffn(*args)
                for got, ref in ((out, ref_out), (hidden, ref_hidden)):
                    assert torch.isfinite(ref).all() and torch.isfinite(got).all(), what
                    assert_matches(got, ref, what)
                bargs = _backward_args(args, ref_hidden, grad, FULL_MASK)
                got = M.grouped_ffn_backward(*bargs, config=cfg)
                ref = torch.ops.torch_moe.grouped_ffn_backward(*bargs)
                for name, a, r in zip(("x", "topk", "w1", "w2", "w3", "b1", "b2", "b3"), got,
                                      ref):
                    assert torch.isfinite(r).all() and torch.isfinite(a).all(), (what, name)
                    assert_matches(a, r, f"{what}: grad_{name}")


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (no interpreter)
# ---------------------------------------------------------------------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D) as a view with stride 2, the column of a 2-D tensor."""
    wide = torch.full((t.size(0), 2), 7, dtype=t.dtype)
    wide[:, 0] = t
    return wide[:, 0]


def _check_strided_routing() -> None:
    """``sorted_ids`` and ``offs`` as strided views (stride 2) give the results of their
    contiguous copies, forward and backward."""
    from torch_moe._triton import grouped_ffn as M

    cfg = _small_config()
    g = torch.Generator().manual_seed(5)
    sorted_ids, offs, topk_weights = _routing("padded", T, K_TOP, E, g)
    x = torch.randn(T, D, generator=g)
    grad = torch.randn(T, D, generator=g)
    weights = _weights("swiglu", "separate", E, D, F, g)
    strided = _forward_args(x, (_strided(sorted_ids), _strided(offs), topk_weights), weights,
                            "swiglu")
    hidden = _compare_forward(lambda *a: M.grouped_ffn(*a, config=cfg), strided, "strided")
    _compare_backward(lambda *a: M.grouped_ffn_backward(*a, config=cfg),
                      _backward_args(strided, hidden, grad, FULL_MASK), "strided backward")
    with deterministic():
        _compare_forward(lambda *a: M.grouped_ffn(*a, config=cfg), strided, "strided det")


def _check_invalid_routing_raises() -> None:
    """The value checks of the CPU kernel, forward and backward: offs decreasing, negative or
    past the slots, ids outside [-1, T * k), an assignment twice (assert_async raises at once on
    CPU tensors)."""
    from torch_moe._triton import grouped_ffn as M

    g = torch.Generator().manual_seed(6)
    sorted_ids, offs, topk_weights = _routing("dense", T, K_TOP, E, g)
    S = sorted_ids.size(0)
    x = torch.randn(T, D, generator=g)
    grad = torch.randn(T, D, generator=g)
    weights = _weights("swiglu", "separate", E, D, F, g)
    hidden = M.grouped_ffn(*_forward_args(x, (sorted_ids, offs, topk_weights), weights,
                                          "swiglu"))[1]
    dup = sorted_ids.clone()
    dup[1] = dup[0]
    cases = [
        ("non-decreasing and non-negative", sorted_ids,
         torch.tensor((5, 4, S), dtype=torch.int32)),
        ("non-decreasing and non-negative", sorted_ids,
         torch.tensor((-1, 4, S), dtype=torch.int32)),
        (r"offs\[-1\] <= sorted_ids.size\(0\)", sorted_ids,
         torch.tensor((4, 4, S + 1), dtype=torch.int32)),
        (r"sorted_ids values in \[-1, 18\)", sorted_ids.clone().fill_(-2), offs),
        (r"sorted_ids values in \[-1, 18\)", sorted_ids.clone().fill_(T * K_TOP), offs),
        ("at most once", dup, offs),
    ]
    for message, ids, bad_offs in cases:
        args = _forward_args(x, (ids, bad_offs, topk_weights), weights, "swiglu")
        for name, fn in (
            ("forward", lambda: M.grouped_ffn(*args)),
            ("backward", lambda: M.grouped_ffn_backward(
                *_backward_args(args, hidden, grad, FULL_MASK))),
            ("CPU op", lambda: torch.ops.torch_moe.grouped_ffn(*args)),
        ):
            try:
                fn()
            except RuntimeError as e:
                assert re.search(message, str(e)), (name, message, str(e))
            else:
                raise AssertionError(f"{name} {message}: no error")


def _check_ffn_configs_fit_shared_memory() -> None:
    """The FFN kernels' tiles on a GPU with little shared memory (sm_103: the sm_90 rows of the
    table, 99 KiB): the gated up kernel's stages, with two weight tiles, fit; the backward's
    kernel (launched with its table pick, never autotuned) takes the narrower columns."""
    from torch_moe._triton import _configs as C, grouped_ffn as M

    M.device_arch = lambda device: (10, 3)
    x = torch.empty(0, 7168, dtype=torch.bfloat16)
    for S, F, E in ((32768, 2048, 8), (4096, 2048, 256)):
        up = M._ffn_config(x, S, F, 7168, E, True, weight_tiles=2)
        used = up.num_stages * (up.block_m * up.block_k + 2 * up.block_k * up.block_n) * 2
        assert used <= C.shared_memory_bytes((10, 3)), up
        rows = C.pick_config("rows", x.dtype, (10, 3), S, F, 7168, E)
        back = M._ffn_config(x, S, F, 7168, E, True)
        assert back.block_n == rows.block_n // 2, (back, rows)


def _check_fake_cuda() -> None:
    """The CUDA kernels run on fake CUDA tensors (nothing is launched, nothing read) and give the
    fake kernels' outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torch_moe
    from torch_moe._triton import cuda_kernel, grouped_ffn as M

    def launched(*args, **kwargs):
        raise AssertionError("a fake tensor run launched a Triton kernel")

    for kernel in (M._ffn_up_kernel, M._ffn_down_backward_kernel, M._group_sum_kernel):
        kernel.run = launched

    S = 40
    with FakeTensorMode():
        def t(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        x, grad = t(T, D), t(T, D)
        sorted_ids, offs, topk = t(S, dtype=torch.int64), t(E, dtype=torch.int32), t(T, K_TOP)
        w2 = t(E, F, D)
        # (activation, w1, w3, H, (b1, b2, b3))
        layouts = {
            "separate": ("swiglu", t(E, D, F), t(E, D, F), 2 * F, ()),
            "fused": ("geglu", t(E, D, 2 * F), None, 2 * F, ()),
            "plain": ("relu", t(E, D, F), None, F, ()),
            # nn.Linear storage [E, F, D] viewed as [E, D, F]: gradients in the weights' strides
            "separate transposed": ("swiglu", t(E, F, D).transpose(1, 2),
                                    t(E, F, D).transpose(1, 2), 2 * F, ()),
            "separate biases": ("swiglu", t(E, D, F), t(E, D, F), 2 * F,
                                (t(E, F), t(E, D), t(E, F))),
            "fused biases": ("geglu", t(E, D, 2 * F), None, 2 * F, (t(E, 2 * F), t(E, D), None)),
        }
        bias_masks = ([False] * 5 + [True] * 3, [False, True] + [False] * 4 + [True, False])
        for name, (activation, w1, w3, H, biases) in layouts.items():
            fwd = (x, sorted_ids, offs, topk, w1, w2, w3, activation, ALPHA, LIMIT, *biases)
            out, hidden = cuda_kernel("grouped_ffn")(*fwd)
            ref = torch_moe._meta_registrations.grouped_ffn_meta(*fwd)
            for a, b in zip((out, hidden), ref):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                assert a.stride() == b.stride() and a.device == b.device, name
            assert hidden.shape == (S, H), name
            for mask in (FULL_MASK, [True, False, True, False, True] + NO_BIASES,
                         [False, True, False, True, False] + NO_BIASES,
                         *(bias_masks if biases else ())):
                bwd = (grad, x, sorted_ids, offs, topk, w1, w2, w3, hidden, activation, ALPHA,
                       LIMIT, mask, *biases)
                got = cuda_kernel("grouped_ffn_backward")(*bwd)
                ref = torch_moe._meta_registrations.grouped_ffn_backward_meta(*bwd)
                for a, b in zip(got, ref):
                    assert a.shape == b.shape and a.dtype == b.dtype, (name, mask)
                    assert a.stride() == b.stride() and a.device == b.device, (name, mask)
            with deterministic():
                cuda_kernel("grouped_ffn")(*fwd)
                cuda_kernel("grouped_ffn_backward")(*bwd)


def _check_graph_capture() -> None:
    """The triton_ops, and the public ops on CUDA tensors, decompose into functional Triton kernel
    wrappers under AOT capture (what Inductor compiles as user-defined kernels), and the mutation
    analysis finds that the FFN kernels write their outputs only, with and without biases."""
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_moe._triton import grouped_ffn as M

    def launched(*args, **kwargs):
        raise AssertionError("graph capture launched a Triton kernel")

    for kernel in (M._ffn_up_kernel, M._ffn_down_backward_kernel, M._group_sum_kernel):
        kernel.run = launched

    class Forward(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, x, sorted_ids, offs, topk, w1, w2, w3, *biases):
            return tuple(self.op(x, sorted_ids, offs, topk, w1, w2, w3, "swiglu", ALPHA, LIMIT,
                                 *biases))

    class Backward(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, grad, x, sorted_ids, offs, topk, w1, w2, w3, hidden, *biases):
            return tuple(self.op(grad, x, sorted_ids, offs, topk, w1, w2, w3, hidden, "swiglu",
                                 ALPHA, LIMIT, FULL_MASK, *biases))

    def inputs(device):
        S = 40
        with FakeTensorMode():
            def t(*shape, dtype=torch.bfloat16):
                return torch.empty(shape, dtype=dtype, device=device)

            routing = (t(S, dtype=torch.int64), t(E, dtype=torch.int32), t(T, K_TOP))
            weights = (t(E, D, F), t(E, F, D), t(E, D, F))
            biases = (t(E, F), t(E, D), t(E, F))
            return {
                "forward": (t(T, D), *routing, *weights),
                "backward": (t(T, D), t(T, D), *routing, *weights, t(S, 2 * F)),
                "forward biases": (t(T, D), *routing, *weights, *biases),
                "backward biases": (t(T, D), t(T, D), *routing, *weights, t(S, 2 * F), *biases),
            }

    def capture(module, args):
        return aot_export_module(module, args, trace_joint=False)[0]

    def targets(gm):
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    forward_op = Forward(torch.ops.torch_moe._triton_grouped_ffn.default)
    backward_op = Backward(torch.ops.torch_moe._triton_grouped_ffn_backward.default)
    triton_ops = {"forward": forward_op, "backward": backward_op,
                  "forward biases": forward_op, "backward biases": backward_op}
    public_ops = {
        "forward": Forward(torch.ops.torch_moe.grouped_ffn.default),
        "backward": Backward(torch.ops.torch_moe.grouped_ffn_backward.default),
    }
    cpu, cuda = inputs("cpu"), inputs("cuda")
    for name, module in triton_ops.items():
        found = targets(capture(module, cpu[name]))
        assert triton_kernel_wrapper_functional in found, (name, found)
        assert not any(str(f).startswith("torch_moe.") for f in found), (name, found)

    # with a GPU target for the Triton frontend, the mutation analysis runs for real
    use_sm90_target()
    # what each kernel writes: the up kernel, the backward's dA kernel (every output requested),
    # grouped_mm's kernels and the bias sums, and permute's inverse map (the routing's range
    # and duplicate check)
    inverse_map = {"slot_ptr", "errors_ptr"}
    written = {
        "forward": [{"hidden_ptr", "act_ptr"}, {"out_ptr"}, inverse_map],
        "backward": [{"dh_ptr", "act_ptr", "part_ptr"}, {"out_ptr"}, inverse_map],
    }
    written["forward biases"], written["backward biases"] = written["forward"], written["backward"]
    for name, module in triton_ops.items():
        gm = capture(module, cpu[name])
        clones = [
            set(n.kwargs["tensors_to_clone"])
            for n in gm.graph.nodes
            if n.target is triton_kernel_wrapper_functional
        ]
        assert written[name][0] in clones, (name, clones)
        assert all(c in written[name] for c in clones), (name, clones)

    # the public ops on CUDA tensors decompose into the Triton kernels; on CPU they stay
    for name, module in public_ops.items():
        found = targets(capture(module, cuda[name]))
        assert triton_kernel_wrapper_functional in found, (name, found)
        assert not any(str(f).startswith("torch_moe.") for f in found), (name, found)
        assert module.op in targets(capture(module, cpu[name])), name


# ---------------------------------------------------------------------------------------------
# The tests (parent process)
# ---------------------------------------------------------------------------------------------


@requires_triton
class TestTritonGroupedFFN(TestCase):
    def _run(self, check: str, interpret: bool = True) -> None:
        run_check(self, "test_triton_grouped_ffn", check, interpret=interpret)

    def test_forward_activations_interpreted(self):
        self._run("_check_forward_activations")

    def test_forward_routings_interpreted(self):
        self._run("_check_forward_routings")

    def test_backward_gated_interpreted(self):
        self._run("_check_backward_gated")

    def test_backward_ungated_interpreted(self):
        self._run("_check_backward_ungated")

    def test_backward_routings_interpreted(self):
        self._run("_check_backward_routings")

    def test_backward_masks_interpreted(self):
        self._run("_check_backward_masks")

    def test_forward_biases_interpreted(self):
        self._run("_check_forward_biases")

    def test_backward_biases_interpreted(self):
        self._run("_check_backward_biases")

    def test_backward_bias_masks_interpreted(self):
        self._run("_check_backward_bias_masks")

    def test_dropped_reads_nothing_interpreted(self):
        self._run("_check_dropped_reads_nothing")

    def test_strided_routing_interpreted(self):
        self._run("_check_strided_routing")

    def test_invalid_routing_raises_interpreted(self):
        self._run("_check_invalid_routing_raises")

    def test_ffn_configs_fit_shared_memory(self):
        self._run("_check_ffn_configs_fit_shared_memory", interpret=False)

    def test_fake_cuda(self):
        self._run("_check_fake_cuda", interpret=False)

    def test_graph_capture(self):
        self._run("_check_graph_capture", interpret=False)


class TestTritonGroupedFFNDevice(TestCase):
    """The public ops on CUDA tensors (the Triton kernels) against the CPU kernels, in fp32."""

    def _problem(self, device, activation, layout, dtype, kind="padded"):
        g = torch.Generator().manual_seed(0)
        num_tokens, k, E_, D_, F_ = 256, 2, 8, 256, 384
        routing = _routing(kind, num_tokens, k, E_, g)
        x = torch.randn(num_tokens, D_, generator=g)
        args = _forward_args(x, routing, _weights(activation, layout, E_, D_, F_, g), activation)
        args = _cast(args, dtype, device)
        args[3] = args[3].float()
        return args

    @onlyCUDA
    def test_grouped_ffn(self, device):
        for activation, layout in _layouts():
            for dtype in (torch.float32, torch.bfloat16):
                for in_order in (False, True):
                    args = self._problem(device, activation, layout, dtype)
                    what = f"{activation} {layout} {dtype} det={in_order}"
                    with deterministic() if in_order else contextlib.nullcontext():
                        _compare_forward(torch.ops.torch_moe.grouped_ffn, args, what)

    @onlyCUDA
    def test_grouped_ffn_routings(self, device):
        for kind in ("dense", "one expert", "dropped"):
            args = self._problem(device, "swiglu", "fused", torch.bfloat16, kind)
            _compare_forward(torch.ops.torch_moe.grouped_ffn, args, kind)
            hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
            grad = torch.randn_like(args[0])
            _compare_backward(
                torch.ops.torch_moe.grouped_ffn_backward,
                _backward_args(args, hidden, grad, FULL_MASK), kind,
            )

    @onlyCUDA
    def test_grouped_ffn_backward(self, device):
        for activation, layout in _layouts():
            for dtype in (torch.float32, torch.bfloat16):
                args = self._problem(device, activation, layout, dtype)
                hidden = torch.ops.torch_moe.grouped_ffn(*args)[1]
                grad = torch.randn_like(args[0])
                for mask in (FULL_MASK, [False, True, False, True, False] + NO_BIASES):
                    for in_order in (False, True):
                        what = f"{activation} {layout} {dtype} {mask} det={in_order}"
                        with deterministic() if in_order else contextlib.nullcontext():
                            _compare_backward(
                                torch.ops.torch_moe.grouped_ffn_backward,
                                _backward_args(args, hidden, grad, mask), what,
                            )


instantiate_device_type_tests(TestTritonGroupedFFNDevice, globals(), only_for="cuda")


if __name__ == "__main__":
    run_tests()
