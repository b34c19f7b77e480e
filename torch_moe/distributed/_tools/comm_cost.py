"""Communication of an MoE layer: token all-to-all and the FSDP / ZeRO collectives of weights.

Every collective is an alpha-beta model: a fixed latency per call (``alpha``) plus bytes over
bandwidth (``1 / beta``), with separate links inside a node (NVLink / Infinity Fabric) and
between nodes (one NIC per GPU).

All-to-all. The expert-parallel group of ``ep`` ranks is laid out node-major: ``gpus_per_node /
etp`` of its ranks per node, so it spans ``ceil(ep * etp / gpus_per_node)`` nodes. Per token,
dispatch sends the number of copies :func:`torch_moe.distributed._dispatch_plan.
expected_copies_per_token` gives (plain ``k``; dedup one per distinct rank), and a copy leaves
the node with probability ``1 - 1 / nodes`` (uniform routing). Node-limited routing (DeepSeek-V3,
``max_nodes = m``) follows DeepEP: one network copy per distinct destination node other than the
source's, then NVLink forwarding to the ranks inside the node; the NVLink and network parts run
at the same time, so a call takes the slower of the two. Combine sends the same rows back.
The receiving side of the most loaded rank sets the time, so bytes are scaled by the rank load
imbalance (most loaded rank over the mean).

FSDP / ZeRO collectives are rings: ``(g - 1)`` steps of ``alpha + bytes / g / bandwidth``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_moe.distributed._dispatch_plan import expected_copies_per_token
from torch_moe.distributed._tools.device_profiles import DeviceProfile

__all__ = [
    "DISPATCH_METHODS",
    "DispatchTraffic",
    "ep_nodes",
    "dispatch_traffic",
    "all_to_all_time_s",
    "ring_collective_time_s",
]

DISPATCH_METHODS = ("plain", "dedup", "node_limited")


def _check_pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, but got {value!r}")
    return value


def ep_nodes(ep: int, etp: int, gpus_per_node: int) -> int:
    """Nodes spanned by one expert-parallel group of ``ep`` ranks whose expert-tensor-parallel
    groups of ``etp`` ranks sit inside a node."""
    _check_pos_int("ep", ep)
    _check_pos_int("etp", etp)
    _check_pos_int("gpus_per_node", gpus_per_node)
    if gpus_per_node % etp != 0:
        raise ValueError(f"etp={etp} must divide gpus_per_node={gpus_per_node}: an expert's "
                         "tensor-parallel shards communicate over the intra-node link")
    span = ep * etp
    if span <= gpus_per_node:
        if gpus_per_node % span != 0:
            raise ValueError(f"ep * etp = {span} must divide gpus_per_node={gpus_per_node} when "
                             "the expert-parallel group fits in one node")
        return 1
    if span % gpus_per_node != 0:
        raise ValueError(f"ep * etp = {span} must be a multiple of gpus_per_node="
                         f"{gpus_per_node} when the expert-parallel group spans nodes")
    return span // gpus_per_node


@dataclass(frozen=True)
class DispatchTraffic:
    """Token copies per source token, by link.

    ``intra_copies``: rows that cross the intra-node link (local copies to ranks of the same
    node, plus NVLink forwarding under node-limited routing). ``inter_copies``: rows that cross
    the network. ``copies``: all destination ranks, the source itself included (the counting
    convention of ``_dispatch_plan``), which sets the rows the experts receive.
    """

    copies: float
    intra_copies: float
    inter_copies: float


def dispatch_traffic(num_experts: int, k: int, ep: int, etp: int, gpus_per_node: int,
                     method: str, max_nodes: int | None = None,
                     rank_shares=None) -> DispatchTraffic:
    """Copies per token under uniform routing for ``method`` in :data:`DISPATCH_METHODS`.

    ``rank_shares``: the share of the assignments each of the ``ep`` ranks' experts receive,
    for a skewed load; a dedup copy count then follows it: a token's ``k`` assignments hit
    rank ``r`` with probability about ``1 - (1 - q_r)^k``, whose sum ``h`` over the ranks is
    mapped linearly onto the copies, ``h = 1`` (the whole load on one rank) to one copy and the
    equal shares' ``h`` to the uniform count. Plain dispatch sends ``k`` copies whatever the
    load.

    ``node_limited`` needs ``max_nodes`` (each token's experts lie on at most that many nodes).
    For it, the closed forms of ``_dispatch_plan`` are upper bounds (``min(k, m)``) that can
    exceed the unconstrained dedup expectation when ``m >= k``; the measured mean never does
    (``_dispatch_plan.expected_copies_per_token`` note), so the smaller of the two is used.
    """
    if method not in DISPATCH_METHODS:
        raise ValueError(f"unknown dispatch method {method!r}: expected one of "
                         f"{DISPATCH_METHODS}")
    nodes = ep_nodes(ep, etp, gpus_per_node)
    remote = 1.0 - 1.0 / nodes
    if method == "plain":
        copies = expected_copies_per_token(num_experts, k, ep, dedup=False)
        return DispatchTraffic(copies, copies * (1.0 - remote), copies * remote)
    dedup = expected_copies_per_token(num_experts, k, ep, dedup=True)
    if rank_shares is not None:
        shares = [float(q) for q in rank_shares]
        total = sum(shares)
        if len(shares) != ep or not total > 0 or any(not q >= 0 for q in shares):
            raise ValueError(f"expected rank_shares to be {ep} non-negative numbers with a "
                             f"positive sum, but got {rank_shares!r}")
        hit = sum(1.0 - (1.0 - q / total) ** k for q in shares)
        uniform_hit = ep * (1.0 - (1.0 - 1.0 / ep) ** k)
        if uniform_hit > 1.0:
            dedup = min(dedup, 1.0 + (dedup - 1.0) * (hit - 1.0) / (uniform_hit - 1.0))
    if method == "dedup":
        return DispatchTraffic(dedup, dedup * (1.0 - remote), dedup * remote)
    if max_nodes is None:
        raise ValueError("dispatch method 'node_limited' needs the model's max_nodes (the "
                         "most nodes a token's experts may span), but got None")
    _check_pos_int("max_nodes", max_nodes)
    if nodes == 1:
        return DispatchTraffic(dedup, dedup, 0.0)
    m = min(max_nodes, nodes)
    ranks_per_node = ep // nodes
    # rank level: the token reaches at most m nodes' worth of ranks
    copies = min(dedup, expected_copies_per_token(num_experts, k, ep, dedup=True,
                                                  max_ranks=m * ranks_per_node))
    node_copies = min(expected_copies_per_token(num_experts, k, nodes, dedup=True),
                      expected_copies_per_token(num_experts, k, nodes, dedup=True,
                                                max_ranks=m))
    # every rank copy crosses NVLink once (local ranks directly, remote ones after the
    # network hop lands on the same-index GPU of the destination node)
    return DispatchTraffic(copies, copies, node_copies * remote)


def all_to_all_time_s(profile: DeviceProfile, intra_bytes: float, inter_bytes: float,
                      calls: int = 1) -> float:
    """Seconds of ``calls`` all-to-all calls that move ``intra_bytes`` over the intra-node link
    and ``inter_bytes`` over the network in total, per rank (the slowest rank's receive side).
    The two links work in parallel; each call pays the latency of every link it uses."""
    if not (intra_bytes >= 0 and inter_bytes >= 0):
        raise ValueError(f"expected non-negative bytes, but got intra={intra_bytes}, "
                         f"inter={inter_bytes}")
    _check_pos_int("calls", calls)
    intra = calls * profile.intra_node_latency_s + intra_bytes / profile.intra_node_bandwidth_Bps
    if inter_bytes == 0:
        return intra
    inter = calls * profile.inter_node_latency_s + inter_bytes / profile.inter_node_bandwidth_Bps
    return max(intra, inter)


def ring_collective_time_s(profile: DeviceProfile, full_bytes: float, group_size: int,
                           spans_nodes: bool) -> float:
    """Seconds of one ring all-gather or reduce-scatter whose *unsharded* tensor has
    ``full_bytes``: ``(g - 1) * (alpha + full_bytes / g / bandwidth)``; zero for ``g = 1``."""
    _check_pos_int("group_size", group_size)
    if not full_bytes >= 0:
        raise ValueError(f"expected full_bytes >= 0, but got {full_bytes}")
    if group_size == 1 or full_bytes == 0:
        return 0.0
    if spans_nodes:
        alpha, bw = profile.inter_node_latency_s, profile.inter_node_bandwidth_Bps
    else:
        alpha, bw = profile.intra_node_latency_s, profile.intra_node_bandwidth_Bps
    return (group_size - 1) * (alpha + full_bytes / group_size / bw)

