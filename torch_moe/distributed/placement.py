"""Expert placement for expert parallelism, with replication of hot experts.

Expert parallelism stores the stacked expert weights ``[E, ...]`` of a layer on ``R`` ranks,
``S`` *physical* expert slots per rank. With ``R * S == E`` every logical expert has exactly one
slot; with ``R * S > E`` the extra slots hold replicas of the most loaded experts, so that a hot
expert's tokens can be served by several ranks. Three steps make up a placement change:

* :func:`plan_placement` turns a per-expert load (``MoE.tokens_per_expert``, all-reduced over
  the data-parallel group) into a :class:`Placement`: how many replicas each expert gets, and
  which rank each physical slot lives on, chosen to minimise the most loaded rank.
* :func:`route_to_replicas` maps the router's logical expert ids to physical slots, spreading an
  expert's tokens evenly over its replicas, on device and without host synchronisation.
* :func:`rebalance_` lays the weights and optimizer state out under the new placement (one
  process holding every row), and :func:`rebalance_distributed_` does it on the ranks of the
  expert-parallel group, each holding its ``S`` rows, with one all-to-all per tensor.

Physical slot ``p`` lives on rank ``p // S``: dim 0 of the physical weights ``[R * S, ...]`` is
sharded contiguously over the expert-parallel group, the way ``Shard(0)`` splits it.
"""

import heapq
import math
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torch_moe.nn._checks import check_expert_ids

__all__ = ["Placement", "plan_placement", "route_to_replicas", "rebalance_",
           "rebalance_distributed_", "zipf_load"]


def _positive_int(fn: str, name: str, value) -> int:
    # bool is an int subclass, but ``num_ranks=True`` is a bug, not a count
    if isinstance(value, bool):
        raise ValueError(f"{fn}: expected {name} to be a positive integer, but got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{fn}: expected {name} to be a positive integer, but got {value!r}") from None
    if value < 1:
        raise ValueError(f"{fn}: expected {name} to be a positive integer, but got {value}")
    return value


# Placement is host-side bookkeeping, one Python-list entry per slot while planning: a bound on
# the physical slots keeps an absurd size an error rather than minutes of planning. 2**16 slots
# (e.g. 1024 ranks of 64 slots, far above today's layers) plan in about a second.
MAX_PHYSICAL_SLOTS = 1 << 16


def _check_placement_arg(fn: str, name: str, value) -> "Placement":
    if not isinstance(value, Placement):
        raise ValueError(f"{fn}: expected {name} to be a Placement, but got "
                         f"{type(value).__name__}")
    return value


def _check_has_data(fn: str, name: str, t: Tensor) -> None:
    # the values are read on the host: a meta tensor has none
    if t.device.type == "meta":
        raise ValueError(f"{fn}: expected {name} on a device with data (its values are read), "
                         f"but got a tensor on the meta device")


def _check_num_slots(fn: str, num_ranks: int, slots_per_rank: int) -> int:
    num_slots = num_ranks * slots_per_rank
    if num_slots > MAX_PHYSICAL_SLOTS:
        raise ValueError(f"{fn}: expected num_ranks * slots_per_rank <= {MAX_PHYSICAL_SLOTS} "
                         f"physical slots, but got {num_ranks} x {slots_per_rank} = {num_slots}")
    return num_slots


@dataclass(frozen=True)
class Placement:
    """Where the physical expert slots of one MoE layer live, and which expert each holds.

    ``P = num_ranks * slots_per_rank`` physical slots, ``E`` logical experts, all tensors int64
    on the CPU (:func:`route_to_replicas` copies the small tables it needs to the ids' device,
    once per device: a blocking copy to a GPU per call would wait for it).

    Attributes:
        phys_to_logical: ``[P]``, the logical expert held by each physical slot.
        logical_to_phys: ``[E, max_replicas]``, the physical slots of each expert in increasing
            order, padded with -1.
        num_replicas: ``[E]``, the number of physical slots of each expert (at least 1).
        rank_of_phys: ``[P]``, the rank of each physical slot, ``p // slots_per_rank``.
        num_ranks: ``R``.
        slots_per_rank: ``S``.
    """

    phys_to_logical: Tensor
    logical_to_phys: Tensor
    num_replicas: Tensor
    rank_of_phys: Tensor
    num_ranks: int
    slots_per_rank: int
    # (name, device) -> tensors derived from the tables, on that device (see _on_device)
    _device_tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _on_device(self, name: str, device: torch.device, make) -> tuple:
        """``make()``'s CPU tensors, which depend on the placement only, on ``device``: copied
        once per placement and device (a blocking copy to a GPU on every call would wait for
        it). ``name`` tells apart what different callers derive."""
        if torch.compiler.is_compiling():
            # a traced graph holds them as constants; the cache would only add guards on it
            return tuple(t.to(device) for t in make())
        key = (name, device)
        tables = self._device_tables.get(key)
        if tables is None:
            tables = self._device_tables[key] = tuple(t.to(device) for t in make())
        return tables

    def _tables_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(num_replicas, logical_to_phys)`` on ``device``, for :func:`route_to_replicas`."""
        return self._on_device("routing", device,
                               lambda: (self.num_replicas, self.logical_to_phys))

    @property
    def num_logical(self) -> int:
        return self.num_replicas.numel()

    @property
    def num_physical(self) -> int:
        return self.phys_to_logical.numel()

    @classmethod
    def from_phys_to_logical(cls, phys_to_logical: Tensor, num_ranks: int,
                             num_logical: int) -> "Placement":
        """Builds the placement that puts ``phys_to_logical [P]`` on ``num_ranks`` ranks of
        ``P // num_ranks`` slots each. Every expert in ``[0, num_logical)`` must appear."""
        fn = "Placement.from_phys_to_logical"
        num_ranks = _positive_int(fn, "num_ranks", num_ranks)
        num_logical = _positive_int(fn, "num_logical", num_logical)
        _check_index_tensor(fn, "phys_to_logical", phys_to_logical, "a 1-D tensor [P]", 1)
        _check_has_data(fn, "phys_to_logical", phys_to_logical)
        num_phys = phys_to_logical.numel()
        if num_phys % num_ranks != 0:
            raise ValueError(f"{fn}: expected the {num_phys} physical slots to split evenly "
                             f"over num_ranks = {num_ranks}, but {num_phys} % {num_ranks} = "
                             f"{num_phys % num_ranks}")
        _check_num_slots(fn, num_ranks, num_phys // num_ranks)
        if num_logical > num_phys:
            raise ValueError(f"{fn}: expected num_logical <= {num_phys} (every expert needs one "
                             f"of the physical slots), but got {num_logical}")
        p2l = phys_to_logical.detach().to("cpu", torch.int64).clone()
        if p2l.min() < 0 or p2l.max() >= num_logical:
            raise ValueError(f"{fn}: expected expert ids in [0, {num_logical}), but got ids in "
                             f"[{p2l.min().item()}, {p2l.max().item()}]")
        num_replicas = torch.bincount(p2l, minlength=num_logical)
        if (num_replicas == 0).any():
            missing = (num_replicas == 0).nonzero().flatten()
            shown = missing[:8].tolist() + (["..."] if missing.numel() > 8 else [])
            raise ValueError(f"{fn}: expected every expert in [0, {num_logical}) to have a "
                             f"physical slot, but experts {shown} ({missing.numel()} in all) "
                             "have none")
        # A stable sort by expert lists each expert's slots in increasing order; the column of
        # a slot is its position after the first slot of its expert.
        order = torch.sort(p2l, stable=True).indices
        first = torch.cumsum(num_replicas, 0) - num_replicas
        column = torch.arange(num_phys) - first[p2l[order]]
        logical_to_phys = torch.full((num_logical, int(num_replicas.max())), -1,
                                     dtype=torch.int64)
        logical_to_phys[p2l[order], column] = order
        slots_per_rank = num_phys // num_ranks
        rank_of_phys = torch.arange(num_phys) // slots_per_rank
        return cls(p2l, logical_to_phys, num_replicas, rank_of_phys, num_ranks, slots_per_rank)

    def rank_loads(self, load: Tensor) -> Tensor:
        """Load of each rank, ``[R]`` float64, when expert e's load ``load [E]`` is split
        equally over its replicas."""
        load = _check_load("Placement.rank_loads", load, self.num_logical)
        share = load[self.phys_to_logical] / self.num_replicas[self.phys_to_logical]
        return torch.zeros(self.num_ranks, dtype=torch.float64).index_add_(
            0, self.rank_of_phys, share)

    def imbalance(self, load: Tensor) -> float:
        """Most loaded rank over the mean rank load: 1.0 is perfect balance, ``R`` the worst.
        An all-zero load counts as balanced."""
        per_rank = self.rank_loads(load)
        mean = per_rank.mean().item()
        return per_rank.max().item() / mean if mean > 0 else 1.0


def _check_load(fn: str, load, num_experts=None) -> Tensor:
    """Validates a per-expert load and returns it as a float64 CPU tensor. Placement is a
    host-side decision taken every few hundred steps, so reading the values here is fine."""
    if not isinstance(load, Tensor):
        raise ValueError(f"{fn}: expected load to be a tensor, but got {type(load).__name__}")
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"{fn}: expected load to be a non-empty 1-D tensor [E], but got shape "
                         f"{tuple(load.shape)}")
    if load.dtype == torch.bool or load.is_complex():
        raise ValueError(f"{fn}: expected load to be an integer or floating tensor, but got "
                         f"{load.dtype}")
    _check_has_data(fn, "load", load)
    if num_experts is not None and load.numel() != num_experts:
        raise ValueError(f"{fn}: expected load of {num_experts} experts, but got "
                         f"{load.numel()}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all():
        bad = (~torch.isfinite(load)).nonzero().flatten().tolist()
        raise ValueError(f"{fn}: expected a finite load, but experts {bad} have load inf or nan")
    if (load < 0).any():
        bad = (load < 0).nonzero().flatten().tolist()
        raise ValueError(f"{fn}: expected a non-negative load, but experts {bad} have negative "
                         f"load")
    return load


def _replica_counts(load: list, num_slots: int, max_per_expert: int) -> list:
    """Hands the ``num_slots - E`` extra slots out one at a time, each to the expert whose
    per-replica share ``load[e] / replicas[e]`` is largest (lowest index on ties): that is
    what lowers the largest item the rank assignment has to place. An expert stops at
    ``max_per_expert`` replicas (one per rank, so replicas never share a rank) unless every
    expert has reached it."""
    num_experts = len(load)
    replicas = [1] * num_experts
    # heap of (-share, expert): the smallest entry is the largest share, ties by lowest index
    heap = [(-load[e], e) for e in range(num_experts)]
    heapq.heapify(heap)
    capped = []
    for _ in range(num_slots - num_experts):
        if not heap:
            # every expert has one replica per rank: go past the cap rather than leave a slot
            # empty, taking the experts back with their current shares
            heap = [(-load[e] / replicas[e], e) for e in capped]
            heapq.heapify(heap)
            capped, max_per_expert = [], num_slots
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        if replicas[e] < max_per_expert:
            heapq.heappush(heap, (-load[e] / replicas[e], e))
        else:
            capped.append(e)
    return replicas


def plan_placement(load: Tensor, num_ranks: int, slots_per_rank: int) -> Placement:
    """Chooses the replicas of each expert and the rank of every physical slot.

    Args:
        load: ``[E]``, non-negative, integer or floating: the tokens routed to each expert over
            the last window (``MoE.tokens_per_expert``, summed over data-parallel ranks).
        num_ranks: ``R``, the size of the expert-parallel group.
        slots_per_rank: ``S``, physical expert slots per rank; ``R * S >= E``.

    Returns:
        A :class:`Placement` with ``R * S`` physical slots. The ``R * S - E`` extra slots go to
        replicas of the most loaded experts, one at a time to the expert with the largest load
        per replica; a replica serves an equal share of its expert's tokens. The replicas are
        then assigned to ranks largest share first, each to the least loaded rank that still
        has a free slot and holds no other replica of the same expert (when such a rank
        exists). Within a rank the slots are ordered by expert id. Ties go to the lowest expert,
        replica and rank index, so the result depends only on the arguments.

    Raises:
        ValueError: on a load that is not a finite, non-negative ``[E]`` tensor with values
            (not on the meta device), on fewer than ``E`` slots, and on more than
            :data:`MAX_PHYSICAL_SLOTS` slots.
    """
    fn = "plan_placement"
    num_ranks = _positive_int(fn, "num_ranks", num_ranks)
    slots_per_rank = _positive_int(fn, "slots_per_rank", slots_per_rank)
    num_slots = _check_num_slots(fn, num_ranks, slots_per_rank)
    loadf = _check_load(fn, load)
    num_experts = loadf.numel()
    if num_slots < num_experts:
        raise ValueError(f"{fn}: expected num_ranks * slots_per_rank >= {num_experts} experts, "
                         f"but got {num_ranks} ranks x {slots_per_rank} slots = {num_slots} "
                         f"physical slots")

    load_list = loadf.tolist()
    replicas = _replica_counts(load_list, num_slots, max_per_expert=num_ranks)

    # Longest-processing-time order: place the large shares while the ranks are still empty,
    # so the small ones at the end fill in the gaps.
    items = sorted(((load_list[e] / replicas[e], e, j)
                    for e in range(num_experts) for j in range(replicas[e])),
                   key=lambda it: (-it[0], it[1], it[2]))
    experts_on = _assign_to_ranks(items, num_ranks, slots_per_rank)
    phys_to_logical = torch.tensor([e for r in range(num_ranks) for e in sorted(experts_on[r])],
                                   dtype=torch.int64)
    return Placement.from_phys_to_logical(phys_to_logical, num_ranks, num_experts)


def _assign_to_ranks(items: list, num_ranks: int, slots_per_rank: int) -> list:
    """Places each ``(share, expert, replica)`` of ``items``, in order, on the least loaded rank
    (lowest index on ties) that has a free slot and holds no replica of the expert yet, or on
    the least loaded rank with a free slot when every one of them holds one. Returns the
    experts of each rank.

    A heap of ``(load, rank)`` over the ranks with free slots finds that rank in ``O(log R)``,
    skipping the ranks that hold the expert; when every open rank holds it, the top of the
    heap is the answer, so no step scans all the ranks."""
    # Two replicas of one expert on one rank would serve its tokens from one place: no better
    # than a single replica, hence the preference for ranks without one.
    heap = [(0.0, r) for r in range(num_ranks)]  # (load, rank) of the ranks with a free slot
    free = [slots_per_rank] * num_ranks
    experts_on = [[] for _ in range(num_ranks)]
    holds = [set() for _ in range(num_ranks)]
    open_holders: dict = {}  # expert -> how many ranks in the heap hold it
    for share, e, _ in items:
        skipped = []
        if open_holders.get(e, 0) < len(heap):
            while e in holds[heap[0][1]]:
                skipped.append(heapq.heappop(heap))
        rank_load, r = heapq.heappop(heap)
        for entry in skipped:
            heapq.heappush(heap, entry)
        free[r] -= 1
        experts_on[r].append(e)
        if e not in holds[r]:
            holds[r].add(e)
            open_holders[e] = open_holders.get(e, 0) + 1
        if free[r] > 0:
            heapq.heappush(heap, (rank_load + share, r))
        else:  # the rank leaves the heap: it no longer counts as an open holder
            for held in holds[r]:
                open_holders[held] -= 1
    return experts_on


def route_to_replicas(topk_ids: Tensor, placement: Placement) -> Tensor:
    """Maps logical expert ids to physical slots, spreading each expert's tokens over its
    replicas.

    The ``n``-th assignment to expert e, counting row-major over ``topk_ids``, goes to replica
    ``n % num_replicas[e]``: every replica of e receives the same number of e's assignments, up
    to one, and the result depends only on ``topk_ids``. Counting is done with a stable sort
    and a ``searchsorted``, so everything stays on the ids' device with no host
    synchronisation. An id outside ``[0, E)`` raises (a negative one would index the tables
    from the end): on the CPU a ``ValueError`` naming the ids' range, elsewhere an on-device
    assert, which needs no host synchronisation either.

    Args:
        topk_ids: ``[T, k]`` int32 or int64 logical expert ids, in ``[0, E)``.
        placement: the :class:`Placement` in use.

    Returns:
        ``[T, k]`` physical slot ids, in ``[0, R * S)``, of the same dtype and device.
    """
    fn = "route_to_replicas"
    _check_index_tensor(fn, "topk_ids", topk_ids, "a 2-D tensor [T, k]", 2)
    _check_placement_arg(fn, "placement", placement)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    _check_logical_ids(fn, flat, placement.num_logical)
    sorted_ids, order = torch.sort(flat, stable=True)
    # position of each assignment among the assignments to its expert: its index in the sorted
    # list minus the index of the expert's first assignment there
    first = torch.searchsorted(sorted_ids, sorted_ids)
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel(), device=device) - first
    num_replicas, logical_to_phys = placement._tables_on(device)
    replica = occurrence % num_replicas[flat]
    phys = logical_to_phys[flat, replica]
    return phys.view(topk_ids.shape).to(topk_ids.dtype)


def _check_index_tensor(fn: str, name: str, t, what: str, dim: int) -> None:
    """``t`` is an int32 / int64 tensor of ``dim`` dimensions (``what`` describes it)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{fn}: expected {name} to be {what}, but got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{fn}: expected {name} to be {what}, but got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: expected {name} to be int32 or int64, but got {t.dtype}")


def _check_logical_ids(fn: str, flat: Tensor, num_logical: int) -> None:
    """Expert ids ``flat [N]`` must lie in ``[0, E)``: a negative id would index the tables from
    the end and send tokens to the last experts' slots. (Meta tensors hold no values.)"""
    if flat.device.type != "meta":
        check_expert_ids(fn, flat, num_logical)


def _check_same_experts(fn: str, old: "Placement", new: "Placement") -> None:
    _check_placement_arg(fn, "old", old)
    _check_placement_arg(fn, "new", new)
    if old.num_logical != new.num_logical:
        raise ValueError(f"{fn}: expected old and new placements of the same number of logical "
                         f"experts, but got {old.num_logical} (old) and {new.num_logical} (new)")


def _check_state(fn: str, state) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"{fn}: expected state to be a dict of tensors, but got "
                         f"{type(state).__name__}")


def rebalance_(state: dict, old: Placement, new: Placement) -> dict:
    """Lays per-expert tensors out under a new placement.

    Every tensor in ``state`` with at least one dim (expert weights such as ``w1 [P_old, D, F]``
    and their optimizer state such as ``exp_avg``) has the physical expert dim first, under
    ``old``; it is replaced by ``[P_new, ...]`` where physical slot p of ``new`` is a copy of
    the row of its logical expert under ``old``. Replicas of one expert hold identical weights
    and optimizer state (their gradients are summed over replicas before the step), so any
    copy will do; if they differ anyway, the first one (lowest physical id under ``old``) is
    taken. 0-dim tensors (``step``) and non-tensors are left as they are.

    This is the single-process version: all rows are local. Under expert parallelism each rank
    holds only its ``S`` rows, and the rows move between ranks with an all-to-all whose
    send counts follow from ``old.rank_of_phys`` and ``new.phys_to_logical``.

    Args:
        state: name to tensor ``[old.num_physical, ...]``; updated in place.
        old, new: placements of the same ``E`` logical experts.

    Returns:
        ``state``, its tensors now ``[new.num_physical, ...]`` and copied bit for bit.
    """
    fn = "rebalance_"
    _check_state(fn, state)
    _check_same_experts(fn, old, new)
    src = old.logical_to_phys[:, 0][new.phys_to_logical]
    for name, t in state.items():
        if isinstance(t, Tensor) and t.dim() > 0 and t.size(0) != old.num_physical:
            raise ValueError(f"{fn}: expected dim 0 of {name!r} to be the {old.num_physical} "
                             f"physical experts of the old placement, but got shape "
                             f"{tuple(t.shape)}")
    for name, t in list(state.items()):
        if isinstance(t, Tensor) and t.dim() > 0:
            state[name] = t.index_select(0, src.to(t.device))
    return state


def rebalance_distributed_(state: dict, old: Placement, new: Placement, group=None) -> dict:
    """:func:`rebalance_` on the ranks of the expert-parallel ``group``.

    Every rank holds the rows of its own slots: each tensor of ``state`` with at least one dim is
    ``[old.slots_per_rank, ...]`` (weights and per-expert optimizer state) and becomes
    ``[new.slots_per_rank, ...]``. New slot ``p`` takes the row of the first old slot of its
    logical expert (``old.logical_to_phys[e, 0]``), so replicas come out identical. The send and
    receive counts follow from the two placements alone (CPU tables every rank has), so there
    is no count exchange and no host synchronisation with the device: one
    ``all_to_all_single`` per tensor moves the rows, bit for bit.

    Args:
        state: name to tensor ``[old.slots_per_rank, ...]``; updated in place.
        old, new: placements of the same ``E`` logical experts over the ``R`` ranks of ``group``.
        group: the expert-parallel process group; the default group when None.

    Returns:
        ``state``, its tensors now ``[new.slots_per_rank, ...]``.
    """
    import torch.distributed as dist

    fn = "rebalance_distributed_"
    _check_state(fn, state)
    _check_same_experts(fn, old, new)
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    if old.num_ranks != R or new.num_ranks != R:
        raise ValueError(f"{fn}: expected placements over the {R} ranks of the group, but got "
                         f"{old.num_ranks} (old) and {new.num_ranks} (new)")
    for name, t in state.items():
        if isinstance(t, Tensor) and t.dim() > 0 and t.size(0) != old.slots_per_rank:
            raise ValueError(f"{fn}: expected dim 0 of {name!r} to be the {old.slots_per_rank} "
                             f"slots of this rank under the old placement, but got shape "
                             f"{tuple(t.shape)}")
    S_old, S_new = old.slots_per_rank, new.slots_per_rank
    src = old.logical_to_phys[:, 0][new.phys_to_logical]  # [P_new] old physical slot
    src_rank = torch.div(src, S_old, rounding_mode="floor")
    dst_rank = torch.arange(new.num_physical) // S_new
    # what this rank sends: rows of its old slots wanted by new slots, ordered by destination
    # rank and, within one, by new slot (the order the receiver expects per source)
    mine = (src_rank == rank).nonzero().flatten()  # new slots served by this rank, ascending
    send_rows = src[mine] - rank * S_old
    send_splits = torch.bincount(dst_rank[mine], minlength=R).tolist()
    # what this rank receives: its new slots, grouped by source rank
    my_slots = torch.arange(rank * S_new, (rank + 1) * S_new)
    order = torch.sort(src_rank[my_slots], stable=True).indices  # received position -> slot
    recv_splits = torch.bincount(src_rank[my_slots], minlength=R).tolist()
    for name, t in list(state.items()):
        if not (isinstance(t, Tensor) and t.dim() > 0):
            continue
        send = t.index_select(0, send_rows.to(t.device)).contiguous()
        recv = t.new_empty((S_new, *t.shape[1:]))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        out = torch.empty_like(recv)
        out[order.to(t.device)] = recv
        state[name] = out
    return state


# the draws are materialised (8 bytes each): 2**26 of them take about a second
_MAX_ZIPF_DRAWS = 1 << 26


def zipf_load(num_experts: int, exponent: float, total: int, seed: int) -> Tensor:
    """A skewed synthetic expert load for planning experiments: ``total`` assignments drawn
    i.i.d. with probability proportional to ``1 / rank**exponent``, where the experts' ranks are
    a random permutation (hot experts are not simply the first ids). Returns ``[E]`` int64
    counts, like ``MoE.tokens_per_expert``; the same arguments give the same counts."""
    fn = "zipf_load"
    num_experts = _positive_int(fn, "num_experts", num_experts)
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not (
            math.isfinite(exponent) and exponent >= 0):
        raise ValueError(f"{fn}: expected exponent to be a finite number >= 0, but got "
                         f"{exponent!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"{fn}: expected total to be an int >= 0, but got {total!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{fn}: expected seed to be an int, but got {seed!r}")
    # one int64 per draw and per expert: bound both so that an absurd size fails fast
    if num_experts > MAX_PHYSICAL_SLOTS:
        raise ValueError(f"{fn}: expected num_experts <= {MAX_PHYSICAL_SLOTS}, but got "
                         f"{num_experts}")
    if total > _MAX_ZIPF_DRAWS:
        raise ValueError(f"{fn}: expected total <= {_MAX_ZIPF_DRAWS} draws, but got {total}")
    if total == 0:
        return torch.zeros(num_experts, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-exponent)
    probs = popularity[torch.randperm(num_experts, generator=gen)]
    draws = torch.multinomial(probs, total, replacement=True, generator=gen)
    return torch.bincount(draws, minlength=num_experts)
