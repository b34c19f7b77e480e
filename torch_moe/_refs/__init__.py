"""Reference implementations of the torch_moe ops: plain loops, obviously correct, slow.

Counterpart of ``torch/_refs``: tests compare every kernel (eager, fake, compiled, sharded)
against these. They use only differentiable torch ops on single rows, so autograd through them
is the reference gradient. Never used by the library itself.
"""

import math

import torch

__all__ = [
    "token_sort",
    "permute",
    "unpermute",
    "grouped_mm",
    "indexed_grouped_mm",
    "activation",
    "moe_ffn",
    "route",
    "moe_layer",
]


def token_sort(topk_ids, num_experts, align=1):
    ids = topk_ids.reshape(-1).tolist()
    groups = [[a for a, e in enumerate(ids) if e == g] for g in range(num_experts)]
    sorted_ids, ends, end = [], [], 0
    for members in groups:
        padded = -(-len(members) // align) * align
        sorted_ids += members + [-1] * (padded - len(members))
        end += padded
        ends.append(end)
    total = len(ids) + (num_experts * (align - 1) if align > 1 else 0)
    sorted_ids += [-1] * (total - len(sorted_ids))
    return (
        torch.tensor(sorted_ids, dtype=torch.int64),
        torch.tensor(ends, dtype=torch.int32),
        torch.tensor([len(m) for m in groups], dtype=torch.int64),
    )


def permute(x, sorted_ids, top_k):
    rows = [x[a // top_k] if a >= 0 else x.new_zeros(x.size(1)) for a in sorted_ids.tolist()]
    return torch.stack(rows) if rows else x.new_zeros((0, x.size(1)))


def unpermute(y, sorted_ids, topk_weights):
    T, k = topk_weights.shape
    out = [torch.zeros_like(y[0]) if y.size(0) else y.new_zeros(y.size(1)) for _ in range(T)]
    for i, a in enumerate(sorted_ids.tolist()):
        if a >= 0:
            out[a // k] = out[a // k] + topk_weights[a // k, a % k] * y[i]
    return torch.stack(out) if T else y.new_zeros((0, y.size(1)))


def _groups(offs):
    start = 0
    for g, end in enumerate(offs.tolist()):
        yield g, start, end
        start = end


def grouped_mm(a, b, offs):
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros((a.size(0), b.size(2)))
        for g, s, e in _groups(offs):
            for r in range(s, e):
                out = out.index_put((torch.tensor([r]),), (a[r] @ b[g]).unsqueeze(0))
        return out
    if a.dim() == 3 and b.dim() == 2:
        cols = [b.new_zeros((a.size(1), 0))]
        last = 0
        for g, s, e in _groups(offs):
            cols.append(a[g] @ b[:, s:e])
            last = e
        cols.append(b.new_zeros((a.size(1), b.size(1) - last)))
        return torch.cat(cols, dim=1)
    mats = [a[:, s:e] @ b[s:e] for _, s, e in _groups(offs)]
    return torch.stack(mats) if mats else a.new_zeros((0, a.size(0), b.size(1)))


def indexed_grouped_mm(input, weight, offs, gather_index=None, scatter_index=None,
                       scatter_weight=None, num_out_rows=-1):
    S = gather_index.numel() if gather_index is not None else input.size(0)
    N = weight.size(2)
    rows = {}
    for g, s, e in _groups(offs):
        for i in range(s, e):
            src = gather_index[i].item() if gather_index is not None else i
            x = input[src] if src >= 0 else input.new_zeros(input.size(1))
            v = x @ weight[g]
            if scatter_weight is not None:
                v = v * scatter_weight[i]
            rows[i] = v
    if scatter_index is None:
        out = [rows.get(i, input.new_zeros(N)) for i in range(S)]
        return torch.stack(out) if out else input.new_zeros((0, N))
    out = [input.new_zeros(N) for _ in range(num_out_rows)]
    for i, v in rows.items():
        dst = scatter_index[i].item()
        if dst >= 0:
            out[dst] = out[dst] + v
    return torch.stack(out) if out else input.new_zeros((0, N))


def activation(kind, g, u=None, alpha=1.702, limit=7.0):
    """Each expert activation written out from its definition with elementary torch ops, so that
    autograd through it is the reference for the fused kernels' hand-written derivatives."""
    def gelu(t):  # the exact, erf-based gelu
        return 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))

    if kind == "swiglu":
        return g * torch.sigmoid(g) * u
    if kind == "geglu":
        return gelu(g) * u
    if kind == "swiglu_oai":
        g = torch.clamp(g, max=limit)
        return (torch.clamp(u, -limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    if kind == "gelu":
        return gelu(g)
    if kind == "relu":
        return torch.where(g > 0, g, torch.zeros_like(g))
    raise ValueError(f"unknown activation {kind!r}")


def moe_ffn(x, topk_ids, topk_weights, w1, w2, w3=None, *, activation_kind="swiglu",
            alpha=1.702, limit=7.0, b1=None, b2=None, b3=None):
    """Per (token, slot) loop: y[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t]), with
    FFN_e(x) = act(x @ w1[e] + b1[e], x @ w3[e] + b3[e]) @ w2[e] + b2[e] (each bias optional;
    with a fused w13, b1 [E, 2F] holds the gate and the up bias)."""
    gated = activation_kind in ("swiglu", "geglu", "swiglu_oai")
    F_ = w2.size(1)

    def affine(v, w, b, e):
        return v @ w[e] + b[e] if b is not None else v @ w[e]

    out = []
    for t in range(x.size(0)):
        y = x.new_zeros(x.size(1))
        for j in range(topk_ids.size(1)):
            e = int(topk_ids[t, j])
            h = affine(x[t], w1, b1, e)
            if gated and w3 is None:
                g, u = h[:F_], h[F_:]
            elif gated:
                g, u = h, affine(x[t], w3, b3, e)
            else:
                g, u = h, None
            a = activation(activation_kind, g, u, alpha, limit)
            y = y + topk_weights[t, j].to(x.dtype) * affine(a, w2, b2, e)
        out.append(y)
    return torch.stack(out) if out else x.new_zeros((0, x.size(1)))


def route(logits_TE, config, expert_bias=None):
    """Per-token routing of an ``MoEConfig``; returns ([[expert ids]], [[weights]]) lists.

    Ties go to the lowest expert id: candidates are ordered by (-value, id).
    """

    c = config
    E, k = c.num_experts, c.top_k
    ids_out, weights_out = [], []
    for logits in logits_TE.double().tolist():
        def score(values):
            if c.score_func == "sigmoid":
                return [1 / (1 + math.exp(-v)) for v in values]
            m = max(values)
            ex = [math.exp(v - m) for v in values]
            return [v / sum(ex) for v in ex]

        if c.topk_before_score:
            chosen = sorted(range(E), key=lambda e: (-logits[e], e))[:k]
            weights = score([logits[e] for e in chosen])
        else:
            s = score(logits)
            sel = [s[e] + (expert_bias[e] if expert_bias is not None else 0.0) for e in range(E)]
            allowed = set(range(E))
            if c.num_expert_groups:
                size = E // c.num_expert_groups
                group_score = [
                    sum(sorted(sel[g * size:(g + 1) * size], reverse=True)[: min(2, size)])
                    for g in range(c.num_expert_groups)
                ]
                top = sorted(range(c.num_expert_groups), key=lambda g: (-group_score[g], g))
                allowed = {e for g in top[: c.topk_groups] for e in range(g * size, (g + 1) * size)}
            chosen = sorted(allowed, key=lambda e: (-sel[e], e))[:k]
            weights = [s[e] for e in chosen]
        if c.normalize_topk:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
        ids_out.append(chosen)
        weights_out.append([w * c.route_scale for w in weights])
    return ids_out, weights_out


def moe_layer(x_TD, moe):
    """Per-token reference of ``torch_moe.nn.MoE`` (eval semantics), in fp64.

    Routing, capacity dropping (per expert, keep the ``capacity`` highest weights, earlier
    assignment first on ties), each selected expert's FFN on the single token row, shared
    experts and their gate.
    """

    c = moe.config
    x = x_TD.double()
    router = moe.router
    # the router computes its logits in fp32 (whatever the parameter dtype); so does this
    logits = x_TD.float() @ router.weight.float().t()
    if router.bias is not None:
        logits = logits + router.bias.float()
    bias = router.expert_bias.tolist() if router.expert_bias is not None else None
    ids, weights = route(logits, c, bias)
    keep = {(t, j) for t in range(len(ids)) for j in range(c.top_k)}
    if c.capacity_factor is not None:
        capacity = math.ceil(c.capacity_factor * len(ids) * c.top_k / c.num_experts)
        for e in range(c.num_experts):
            members = [(t, j) for t in range(len(ids)) for j in range(c.top_k) if ids[t][j] == e]
            members.sort(key=lambda tj: (-weights[tj[0]][tj[1]], tj[0] * c.top_k + tj[1]))
            for tj in members[capacity:]:
                keep.discard(tj)
    ex = moe.experts
    w1, w2 = ex.w1.double(), ex.w2.double()
    w3 = ex.w3.double() if ex.w3 is not None else None
    rows = []
    for t in range(x.size(0)):
        y = x.new_zeros(x.size(1))
        for j in range(c.top_k):
            if (t, j) not in keep:
                continue
            e = ids[t][j]
            up = x[t] @ w3[e] if w3 is not None else None
            a = activation(c.activation, x[t] @ w1[e], up, c.swiglu_alpha, c.swiglu_limit)
            y = y + weights[t][j] * (a @ w2[e])
        if moe.shared_experts is not None:
            sh = moe.shared_experts
            up = x[t] @ sh.w3.double() if sh.w3 is not None else None
            s = activation(c.activation, x[t] @ sh.w1.double(), up, c.swiglu_alpha,
                           c.swiglu_limit) @ sh.w2.double()
            if sh.gate is not None:
                s = s * torch.sigmoid(x[t] @ sh.gate.double()[0])
            y = y + s
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros((0, x.size(1)))
