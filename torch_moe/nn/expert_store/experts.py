"""Routed experts computed from an :class:`~torch_moe.nn.expert_store.cache.ExpertCache`.

:class:`OffloadedExperts` stands in for :class:`~torch_moe.nn.GroupedExperts` inside an
:class:`~torch_moe.nn.MoE` (same ``forward`` signature: the rows sorted by ``token_sort``), with
frozen experts: gradients reach the tokens and the routing weights (so the router, the shared
experts and everything before the layer train), never the experts.

Calls, and why the result is bit-identical to the resident layer
-----------------------------------------------------------------
A step's experts rarely fit in the cache at once, so a step computes them in several calls, each
over the experts whose slots have loaded. Summing per-call outputs (``out_1 + out_2``) would
change the association of each token's fp32 sum. Instead, each call computes the *unweighted*
output of every sorted slot of its experts, ``o_i = FFN_e(x_t)`` (independent of the call), on
the expert's rows as one GEMM group of the same size as in the resident op. After the last call
the slots are weighted and combined once, in ascending sorted slot order, starting from zeros,
by ``index_add_`` in fp32: the sequence of roundings of the resident kernel
(``torch_moe._native.cpu.grouped_ffn``).

* Forward on a CPU: :class:`torch_moe._native.cpu.ExpertFFN`, the fused kernel's own block
  computation in its per-group form without the op's routing and combine, on the rows of the
  experts that are there, as soon as they are: one expert whose load has just landed, or every
  expert whose load is done (the resident ones at the start of a step).
* Forward elsewhere, and backward: the fused ops in passes of half the slots (the next pass's
  experts load into the other half while one computes), on a problem in which every sorted slot
  is a token of its own with routing weight 1 (``1.0 * o_i`` and ``0 + o_i`` are exact). The
  backward yields per-slot ``dX_i`` and ``<dA_i, act_i>``, then one ordered ``index_add_`` into
  ``grad_x``.

Either way the experts' GEMMs run one per expert (the per-group form, fixed with
``torch_moe.cpu.expert_form("per_group")`` for the fused ops), the only form in which an
expert's rows are computed independently of which other experts share the call: the batched
form's ``bmm`` over several experts may round an expert's products differently with other
neighbours, and a call holds other neighbours than the resident layer's single call.
Bit-identity is therefore to the resident layer in the per-group form (the default); against a
resident layer in the ``"auto"`` or ``"batched"`` form, which batch runs of small similar
experts, outputs and gradients agree to fp32 rounding (the batched form's summation order, a
relative 1e-6 or so).

Order: experts already resident first, then the missing ones; their slots are requested as far
ahead as the cache allows, so the loads queue in the order the compute needs them.

Prefetch: once its own loads are queued, a layer predicts the experts of the next layer by
running the next layer's router on its own input (``prefetch="router"``) or takes the experts
the next layer used last time (``"previous"``), and queues their loads behind its own; with
``"router"`` it also predicts the layer after that (:data:`HINT_LAYERS`) and hints those
experts to a tier that takes hints (``takes_hints``: the file tier over a page cache of single
pages), which reads them ahead without a slot. The backward of a layer prefetches
exactly what the previous layer's forward used.
"""

import collections
from typing import Optional

import torch
from torch import nn, Tensor

from torch_moe._native._expert_blocks import use_form as expert_form
from torch_moe._native.cpu import ExpertFFN
from torch_moe.nn import _checks as C
from torch_moe.nn.expert_store._loader import NEXT_LAYER
from torch_moe.nn.expert_store.cache import ExpertCache

__all__ = ["OffloadedExperts", "PREFETCH"]

PREFETCH = (None, "router", "previous")
# layers past the next one that router prefetch hints
HINT_LAYERS = 1


class OffloadedExperts(nn.Module):
    """The routed experts of one MoE layer, read through an expert cache (no parameters)."""

    def __init__(self, config, cache: ExpertCache, prefetch: Optional[str] = "router"):
        super().__init__()
        if prefetch not in PREFETCH:
            raise ValueError(f"OffloadedExperts: expected prefetch in {PREFETCH}, but got "
                             f"{prefetch!r}")
        self.config = config
        self.cache = cache
        self.prefetch = prefetch
        # set by link(): the experts and router of the next and previous MoE layers
        self._links = {"next": None, "next_router": None, "prev": None}
        self._last_needed: list = []

    def link(self, next_layer=None, next_router=None, prev_layer=None) -> None:
        """Names the layers this one prefetches for (``offload_experts`` links consecutive
        layers). Held in a plain dict, not as submodules: the neighbours' parameters stay
        theirs (``named_parameters``, ``state_dict``) and the links make no module cycle."""
        if next_layer is not None:
            self._links["next"] = next_layer
        if next_router is not None:
            self._links["next_router"] = next_router
        if prev_layer is not None:
            self._links["prev"] = prev_layer

    @property
    def _next(self):
        return self._links["next"]

    @property
    def _next_router(self):
        return self._links["next_router"]

    @property
    def _prev(self):
        return self._links["prev"]

    def extra_repr(self) -> str:
        c = self.cache
        return (f"layer={c.layer!r}, num_experts={c.spec.num_experts}, "
                f"cache_experts={c.num_slots}, policy={type(c.policy).__name__}, "
                f"prefetch={self.prefetch!r}")

    def forward(self, x_TD, sorted_ids, offs, topk_weights, topk_ids=None) -> Tensor:
        """``y [T, D]`` as :meth:`GroupedExperts.forward` computes it (``offs`` from
        ``token_sort`` without alignment)."""
        c = self.config
        C.check_tokens("OffloadedExperts", "x", x_TD, c.dim)
        E = self.cache.spec.num_experts
        if offs.dim() != 1 or offs.numel() != E:
            raise ValueError(f"OffloadedExperts: expected offs [{E}] (one group per expert), but "
                             f"got shape {tuple(offs.shape)}")
        if topk_weights.dim() != 2 or topk_weights.size(0) != x_TD.size(0):
            raise ValueError(f"OffloadedExperts: expected topk_weights [{x_TD.size(0)}, k], but "
                             f"got shape {tuple(topk_weights.shape)}")
        x_TD = x_TD.to(self.cache.spec.dtype)
        return _OffloadedFFN.apply(x_TD, topk_weights, self, sorted_ids, offs)

    # -- prefetch ---------------------------------------------------------------------------

    @torch.no_grad()
    def _prefetch_next(self, x_TD: Tensor) -> None:
        nxt = self._next
        if nxt is None or self.prefetch is None:
            return
        if self.prefetch == "router" and self._next_router is not None:
            wanted = _predict(self._next_router, nxt, x_TD)
        else:
            wanted = list(nxt._last_needed)
        C_ = nxt.cache.num_slots
        nxt.cache.prefetch(wanted[:C_], NEXT_LAYER, next_step=True, keep=wanted[C_:])
        if self.prefetch != "router":
            return
        # further ahead the guess is worth a read from the disk, not a slot: hints that the
        # tier reads ahead behind every load (a CPU file's pages into the page cache)
        layer = nxt
        for _ in range(HINT_LAYERS):
            after, router = layer._next, layer._next_router
            if after is None or router is None or not after.cache.tier.takes_hints:
                break
            after.cache.hint(_predict(router, after, x_TD)[: after.cache.num_slots])
            layer = after

    def _prefetch_prev_backward(self) -> None:
        prev = self._prev
        if prev is not None and self.prefetch is not None:
            prev.cache.prefetch(prev._last_needed[: prev.cache.num_slots], NEXT_LAYER,
                                next_step=True)

    # -- scheduling -------------------------------------------------------------------------

    def _chunks(self, needed: list, chunk: int) -> list:
        """``needed`` in compute order, resident experts first, cut into chunks of ``chunk``."""
        cache = self.cache
        order = ([e for e in needed if cache.resident(e)]
                 + [e for e in needed if not cache.resident(e)])
        return [order[i : i + chunk] for i in range(0, len(order), chunk)]

    def _pass_size(self) -> int:
        """Experts per fused-op pass: the whole cache, or half of it with an asynchronous loader
        (double buffering: the next pass's loads go to the slots this pass does not hold)."""
        C_ = self.cache.num_slots
        return max(1, C_ // 2) if self.cache.loader.asynchronous else C_

    def _run(self, needed: list, chunk: int, compute, merge: bool = False,
             after_first=None) -> None:
        """Runs ``compute(experts, slots)`` over ``needed`` in chunks of ``chunk`` experts.

        The chunks are requested in compute order as far ahead as the slots allow (each one's
        slots pinned and its loads queued as soon as there is room for them), so that the loads
        run while earlier chunks compute; a chunk's slots are given back (and its experts may be
        evicted) as soon as it has run, which makes room for the next request. With ``merge``,
        the chunks after the one waited for whose loads are done already join its call (one
        call for all the experts that are there: the resident ones at the start of a step, the
        prefetched ones). ``after_first`` runs once the first requests are queued (the next
        layer's prefetch goes behind them)."""
        cache = self.cache
        chunks = self._chunks(needed, chunk)
        cache.begin_step(needed)
        pending = collections.deque()  # (experts, slots): requested, not yet computed
        i = 0
        try:
            while i < len(chunks) or pending:
                while i < len(chunks) and cache.room_for(chunks[i]):
                    pending.append((chunks[i], cache.request(chunks[i])))
                    i += 1
                if after_first is not None:
                    after_first()
                    after_first = None
                if not pending:
                    raise RuntimeError(
                        f"expert cache of layer {cache.layer!r}: no room for experts "
                        f"{chunks[i]}: all {cache.num_slots} slots are pinned or hold experts "
                        "this step needs")
                experts, slots = pending.popleft()
                try:
                    cache.wait(slots)
                    while merge and pending and cache.loaded(pending[0][1]):
                        more, more_slots = pending.popleft()
                        experts, slots = experts + more, slots + more_slots
                        cache.wait(more_slots)
                    compute(experts, slots)
                finally:
                    cache.release(slots)
                cache.finished(experts)
        finally:
            for _, slots in pending:  # an error left them requested
                cache.release(slots)
            cache.end_step()


def _predict(router, layer: "OffloadedExperts", x_TD: Tensor) -> list:
    """The experts ``router`` (``layer``'s) picks for the tokens ``x_TD`` (an earlier layer's
    input), most wanted first: a prediction larger than the cache keeps its best experts."""
    ids = torch.topk(router.logits(x_TD), layer.config.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=layer.cache.spec.num_experts)
    order = torch.argsort(counts, descending=True, stable=True)
    return order[: int((counts > 0).sum())].tolist()


class _Routing:
    """The sorted slots of a step, read on the host once: group bounds per expert, the token of
    each sorted slot (``rows [n]``) and its routing weight (``w_S [n]``, fp32), for the
    ``n = offs[-1]`` slots that a group holds (a capacity limit's dropped tail is left out, as
    the fused op leaves it)."""

    def __init__(self, sorted_ids: Tensor, offs: Tensor, topk_weights: Tensor, acc: torch.dtype):
        ends = offs.tolist()
        self.bounds = {}
        start = 0
        for e, end in enumerate(ends):
            if end < start:
                raise ValueError(f"OffloadedExperts: expected offs non-decreasing, but offs[{e}] = "
                                 f"{end} < {start}")
            if end > start:
                self.bounds[e] = (start, end)
            start = end
        if start > sorted_ids.numel():
            raise ValueError(f"OffloadedExperts: offs[-1] = {start} exceeds the {sorted_ids.numel()} "
                             "sorted slots")
        self.n = start
        self.needed = list(self.bounds)
        ids = sorted_ids[:start]
        k = topk_weights.size(1)
        if start and (int(ids.min()) < 0 or int(ids.max()) >= topk_weights.numel()):
            raise ValueError("OffloadedExperts: expected sorted_ids in [0, T * k) inside the groups "
                             "(align=1, as token_sort gives)")
        self.ids = ids
        self.rows = torch.div(ids, k, rounding_mode="floor")
        self.w_S = topk_weights.reshape(-1)[ids].to(acc)

    def pass_layout(self, experts: list, slots: list, num_slots: int, device):
        """For a pass over ``experts`` in cache ``slots``: the positions (into the sorted slots) of
        its rows, grouped by slot in ascending slot order, and the ``offs [C]`` of that order."""
        by_slot = sorted(zip(slots, experts))
        sizes = [0] * num_slots
        pieces = []
        for slot, e in by_slot:
            s, t = self.bounds[e]
            sizes[slot] = t - s
            pieces.append(torch.arange(s, t, device=device))
        pos = torch.cat(pieces)
        offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
        return pos, offs


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    # what the fused op accumulates the combine in
    return torch.float64 if dtype == torch.float64 else torch.float32


class _OffloadedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, module, sorted_ids, offs):
        cache, cfg = module.cache, module.config
        acc = _accumulate_dtype(x.dtype)
        r = _Routing(sorted_ids, offs, topk_weights, acc)
        T, D = x.shape
        H = (2 if cfg.gated else 1) * cfg.hidden_dim
        # unweighted outputs in the accumulation dtype: what the fused op weights and combines
        o_S = x.new_empty((r.n, D), dtype=acc)
        hidden_S = x.new_empty((r.n, H))
        act = (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)

        if x.device.type == "cpu":
            # each expert as soon as its slot is loaded, on its own rows: no pass to wait for
            sw = cache.slot_weights
            ffn = ExpertFFN(sw["w1"], sw["w2"], sw.get("w3"), *act,
                            **{n: sw[n] for n in ("b1", "b2", "b3") if n in sw},
                            dtype=cache.spec.dtype)

            def compute(experts, slots):
                # in sorted-slot order: the rows of experts adjacent in the routing are
                # adjacent, and a run of them is written in place
                run = sorted(zip(experts, slots))
                spans = [r.bounds[e] for e, _ in run]
                groups = [(slot, t - s) for (_, slot), (s, t) in zip(run, spans)]
                if all(spans[j][1] == spans[j + 1][0] for j in range(len(spans) - 1)):
                    s, t = spans[0][0], spans[-1][1]
                    ffn(groups, x.index_select(0, r.rows[s:t]), hidden_S[s:t], o_S[s:t])
                    return
                pos = torch.tensor([i for s, t in spans for i in range(s, t)], device=x.device)
                o_p = o_S.new_empty((pos.numel(), D))
                h_p = hidden_S.new_empty((pos.numel(), H))
                ffn(groups, x.index_select(0, r.rows[pos]), h_p, o_p)
                hidden_S.index_copy_(0, pos, h_p)
                o_S.index_copy_(0, pos, o_p)

            chunk, merge = 1, True
        else:
            def compute(experts, slots):
                w, groups = cache.stacked(slots)
                pos, offs_p = r.pass_layout(experts, groups, w["w1"].size(0), x.device)
                x_p = x[r.rows[pos]]
                n = pos.numel()
                self_ids = torch.arange(n, device=x.device)
                ones = torch.ones((n, 1), dtype=topk_weights.dtype, device=x.device)
                with expert_form("per_group"):
                    out_p, hidden_p = torch.ops.torch_moe.grouped_ffn(
                        x_p, self_ids, offs_p, ones, w["w1"], w["w2"], w.get("w3"), *act,
                        **{b: w[b] for b in ("b1", "b2", "b3") if b in w})
                o_S[pos] = out_p.to(acc)
                hidden_S[pos] = hidden_p

            chunk, merge = module._pass_size(), False

        module._last_needed = r.needed
        module._run(r.needed, chunk, compute, merge=merge,
                    after_first=lambda: module._prefetch_next(x))
        if not r.needed:
            module._prefetch_next(x)
        # weight and combine once, in sorted-slot order, from zeros, in the accumulation dtype
        y = o_S.mul_(r.w_S.unsqueeze(1))
        out = torch.zeros((T, D), dtype=acc, device=x.device)
        if r.n:
            out.index_add_(0, r.rows, y)
        ctx.module = module
        ctx.save_for_backward(x, topk_weights, sorted_ids, offs, hidden_S)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, topk_weights, sorted_ids, offs, hidden_S = ctx.saved_tensors
        module = ctx.module
        cache, cfg = module.cache, module.config
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _accumulate_dtype(x.dtype)
        r = _Routing(sorted_ids, offs, topk_weights, acc)
        T, D = x.shape
        gx_S = x.new_empty((r.n, D)) if want_x else None
        gw_S = torch.empty(r.n, dtype=topk_weights.dtype, device=x.device) if want_w else None
        mask = [want_x, want_w] + [False] * 6
        grad = grad.contiguous()

        def compute(experts, slots):
            w, groups = cache.stacked(slots)
            pos, offs_p = r.pass_layout(experts, groups, w["w1"].size(0), x.device)
            rows = r.rows[pos]
            n = pos.numel()
            self_ids = torch.arange(n, device=x.device)
            w_p = topk_weights.reshape(-1)[r.ids[pos]].reshape(n, 1)
            with expert_form("per_group"):
                gx_p, gw_p, *_ = torch.ops.torch_moe.grouped_ffn_backward(
                    grad[rows], x[rows], self_ids, offs_p, w_p, w["w1"], w["w2"], w.get("w3"),
                    hidden_S[pos], cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, mask,
                    **{b: w[b] for b in ("b1", "b2", "b3") if b in w})
            if want_x:
                gx_S[pos] = gx_p
            if want_w:
                gw_S[pos] = gw_p.reshape(n)

        if want_x or want_w:
            module._run(r.needed, module._pass_size(), compute,
                        after_first=module._prefetch_prev_backward)
        grad_x = grad_w = None
        if want_x:
            acc_x = torch.zeros((T, D), dtype=acc, device=x.device)
            if r.n:
                acc_x.index_add_(0, r.rows, gx_S if gx_S.dtype == acc else gx_S.to(acc))
            grad_x = acc_x if acc_x.dtype == x.dtype else acc_x.to(x.dtype)
        if want_w:
            grad_w = torch.zeros(topk_weights.numel(), dtype=topk_weights.dtype, device=x.device)
            grad_w[r.ids] = gw_S
            grad_w = grad_w.view(topk_weights.shape)
        return grad_x, grad_w, None, None, None
