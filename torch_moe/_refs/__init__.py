"""Reference implementations of the torch_moe ops: plain loops, obviously correct, slow.

Counterpart of ``torch/_refs``: tests compare every kernel (eager, fake, compiled, sharded)
against these. They use only differentiable torch ops on single rows, so autograd through them
is the reference gradient. Never used by the library itself.
"""

import torch
import torch.nn.functional as F

__all__ = [
    "token_sort",
    "permute",
    "unpermute",
    "grouped_mm",
    "indexed_grouped_mm",
    "activation",
    "moe_ffn",
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
    if kind == "swiglu":
        return F.silu(g) * u
    if kind == "geglu":
        return F.gelu(g) * u
    if kind == "swiglu_oai":
        g = g.clamp(max=limit)
        return (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    if kind == "gelu":
        return F.gelu(g)
    if kind == "relu":
        return F.relu(g)
    raise ValueError(kind)


def moe_ffn(x, topk_ids, topk_weights, w1, w2, w3=None, *, activation_kind="swiglu",
            alpha=1.702, limit=7.0):
    """Per (token, slot) loop: y[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t])."""
    gated = activation_kind in ("swiglu", "geglu", "swiglu_oai")
    F_ = w2.size(1)
    out = []
    for t in range(x.size(0)):
        y = x.new_zeros(x.size(1))
        for j in range(topk_ids.size(1)):
            e = int(topk_ids[t, j])
            h = x[t] @ w1[e]
            if gated and w3 is None:
                g, u = h[:F_], h[F_:]
            elif gated:
                g, u = h, x[t] @ w3[e]
            else:
                g, u = h, None
            a = activation(activation_kind, g, u, alpha, limit)
            y = y + topk_weights[t, j].to(x.dtype) * (a @ w2[e])
        out.append(y)
    return torch.stack(out) if out else x.new_zeros((0, x.size(1)))
