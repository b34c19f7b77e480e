"""The fast tier: a fixed number of expert slots per layer, and the cache that fills them.

A slot holds one expert's tensors (``w1 [D, F]``, ``w3 [D, F]``, ``w2 [F, D]``, biases ``[F]`` /
``[D]``), in one of two ways, chosen by the tier and the device:

* copied (a GPU cache, or a host tier): ``ExpertCache`` owns preallocated slot tensors
  (``slots["w1"] [C, D, F]``, ...) on the compute device, and a load copies into one. Nothing
  is allocated after construction.
* mapped (a CPU cache over the file tier): a slot is the expert's own pages of the file's
  mapping. A load makes them resident in the process (read from the disk if the page cache
  does not hold them, and mapped), an eviction unmaps them again (and, for a file larger than
  RAM, drops them from the page cache). On a CPU a copy of a mapped page into another buffer of
  the same memory moves every byte twice for nothing: copying a 1.5 MiB expert out of the page
  cache with ``preadv`` runs at 5.5 GB/s on an otherwise idle core, while mapping the same
  pages in (``MADV_POPULATE_READ``) and out again takes 64 us, 24 GB/s, and leaves the memory
  bandwidth to the compute. The resident set still holds the cache's experts, no more (give or
take the kernel's fault-around, which maps neighbouring pages that the page cache holds: up to
64 KiB either side of an expert by default).

Either way ``slot_weights[name][slot]`` is the slot's tensor ``name`` (a view of ``slots[name]``
or of the mapping), what the compute reads.

Invariants (each kept by one method):
* a pinned slot (``acquire`` until ``release``) is never chosen as a victim, so neither a
  demand load nor a prefetch can overwrite what a computation reads;
* within a step (``begin_step`` .. ``end_step``), an expert the step needs and that is resident
  is never evicted, so no needed expert is read twice in one step;
* a slot's expert is usable only after its load's ticket has been waited on (``acquire``).

All cache state is read and written by the compute thread only; a loader thread only runs the
load jobs, which check a per-slot generation so that a load whose slot was reassigned before it
ran does nothing. (An unmapping that races a mapping of the same pages can only leave pages
resident or make a later read fault them in again: the mapping is private and never written,
so what a computation reads is the file's bytes either way.)
"""

import threading
from collections import Counter
from dataclasses import dataclass, fields

import torch

from torch_moe.nn.expert_store._loader import DEMAND
from torch_moe.nn.expert_store.policy import make_policy
from torch_moe.nn.expert_store.tiers import ExpertSpec, SlowTier

__all__ = ["CacheStats", "ExpertCache"]


@dataclass
class CacheStats:
    """Counters of one layer's cache (or their sum over layers).

    requests: needed experts, counted once per step. hits / misses: needed experts resident /
    not resident when the step began. prefetch_hits: hits on an expert that a prefetch from an
    earlier layer brought in. prefetches: loads issued ahead of need. loads, bytes_moved: copies
    from the slow tier actually run. stall_s: seconds the compute thread waited for loads.
    max_reads_per_step: the most times one expert was read within one step (1 means no expert is
    ever read twice for one step).
    """

    steps: int = 0
    requests: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    prefetches: int = 0
    loads: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    max_reads_per_step: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else float("nan")

    def __add__(self, other: "CacheStats") -> "CacheStats":
        out = CacheStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "max_reads_per_step" else a + b)
        return out


class ExpertCache:
    def __init__(self, layer: str, spec: ExpertSpec, tier: SlowTier, num_slots: int,
                 device: torch.device, policy: str, loader):
        self.layer, self.spec, self.tier, self.loader = layer, spec, tier, loader
        self.num_slots = num_slots
        self.device = device
        self.policy = make_policy(policy)
        self.mapped = device.type == "cpu" and tier.maps_experts
        if self.mapped:
            self.slots: dict = {}
            self.slot_weights = {name: [None] * num_slots for name in spec.shapes}
        else:
            self.slots = {name: torch.empty((num_slots, *shape), dtype=spec.dtype, device=device)
                          for name, shape in spec.shapes.items()}
            self.slot_weights = {name: list(t.unbind(0)) for name, t in self.slots.items()}
        self._expert = [None] * num_slots     # expert held (or being loaded) by each slot
        self._slot_of: dict = {}              # expert -> slot
        self._pins = [0] * num_slots
        self._ticket = [None] * num_slots     # the load a slot's user must wait for
        self._gen = [0] * num_slots           # bumped when a slot is reassigned
        self._prefetched = [False] * num_slots
        self._mapped_out = [None] * num_slots  # mapped: the expert whose pages a slot maps
        self._reserved: set = set()           # needed by passes of this step yet to run
        self._step = 0
        self._reads: Counter = Counter()      # (step, expert) -> reads
        self._lock = threading.Lock()         # the loader thread updates loads / bytes / reads
        self._names = list(spec.shapes)
        self._nbytes = spec.nbytes()
        self.stats = CacheStats()

    # -- steps ------------------------------------------------------------------------------

    def begin_step(self, needed: list) -> None:
        """A computation over ``needed`` (expert ids) starts: count hits and misses, tell the
        policy, and protect the needed experts from eviction until their pass has run
        (:meth:`finished`)."""
        self._check_frozen()
        s = self.stats
        self._step += 1
        s.steps += 1
        s.requests += len(needed)
        for e in needed:
            slot = self._slot_of.get(e)
            if slot is None:
                s.misses += 1
            else:
                s.hits += 1
                if self._prefetched[slot]:
                    s.prefetch_hits += 1
                    self._prefetched[slot] = False
            self.policy.touch(e)
        self._reserved = set(needed)
        if self.loader.cancellable:
            self._cancel_stale_prefetches()
        with self._lock:  # forget the reads of finished steps
            for key in [k for k in self._reads if k[0] < self._step - 1]:
                del self._reads[key]

    def _cancel_stale_prefetches(self) -> None:
        """Prefetches for this step that have not landed and that the step does not need were
        mispredicted: free their slots, so the loader skips the copies that have not started
        and the bandwidth goes to loads that are needed."""
        for slot, e in enumerate(self._expert):
            ticket = self._ticket[slot]
            if (e is not None and self._prefetched[slot] and e not in self._reserved
                    and ticket is not None and not self.loader.ready(ticket)):
                self._gen[slot] += 1
                del self._slot_of[e]
                self._expert[slot] = None
                self._prefetched[slot] = False
                self._ticket[slot] = None

    def finished(self, experts: list) -> None:
        """The step is done with ``experts`` (their pass ran): they may be evicted again."""
        self._reserved.difference_update(experts)

    def end_step(self) -> None:
        self._reserved = set()

    def resident(self, expert: int) -> bool:
        return expert in self._slot_of

    # -- slots ------------------------------------------------------------------------------

    def acquire(self, experts: list) -> list:
        """Slots holding ``experts``, loaded and pinned: :meth:`request` then :meth:`wait`."""
        slots = self.request(experts)
        self.wait(slots)
        return slots

    def request(self, experts: list) -> list:
        """Pins a slot for each of ``experts`` and queues the demand loads of the missing ones,
        without waiting for them (so that lower-priority prefetches can be queued behind them
        before the compute thread blocks). Use the slots only after :meth:`wait`."""
        slots = []
        for e in experts:
            slot = self._slot_of.get(e)
            if slot is None:
                slot = self._victim_slot(protect=experts)
                if slot is None:
                    raise RuntimeError(
                        f"expert cache of layer {self.layer!r}: no slot for expert {e}: all "
                        f"{self.num_slots} slots are pinned or hold experts this step needs")
                self._load(slot, e, DEMAND, prefetched=False, step=self._step)
            self._prefetched[slot] = False
            self._pins[slot] += 1
            slots.append(slot)
        return slots

    def room_for(self, experts: list) -> bool:
        """Whether :meth:`request` of ``experts`` would find a slot for each missing one now:
        free slots and slots whose expert is neither pinned, nor needed by the step, nor among
        ``experts``."""
        missing = sum(1 for e in experts if e not in self._slot_of)
        if not missing:
            return True
        wanted = set(experts)
        room = 0
        for slot, e in enumerate(self._expert):
            if not self._pins[slot] and (e is None or (e not in self._reserved
                                                        and e not in wanted)):
                room += 1
                if room >= missing:
                    return True
        return False

    def loaded(self, slots: list) -> bool:
        """Whether the loads into ``slots`` are done (:meth:`wait` would not block)."""
        return all(self._ticket[s] is None or self.loader.ready(self._ticket[s]) for s in slots)

    def wait(self, slots: list) -> None:
        """Blocks until the loads into ``slots`` are done (the stall is counted)."""
        for slot in slots:
            ticket = self._ticket[slot]
            if ticket is not None:
                self._ticket[slot] = None
                self.stats.stall_s += self.loader.wait(ticket)

    def release(self, slots: list) -> None:
        for slot in slots:
            if self._pins[slot] <= 0:
                raise RuntimeError(f"expert cache of layer {self.layer!r}: slot {slot} released "
                                   "more often than acquired")
            self._pins[slot] -= 1
            if self._pins[slot] == 0:
                self.loader.released((id(self), slot))

    def prefetch(self, experts: list, priority: int, next_step: bool, keep=()) -> int:
        """Starts loading those of ``experts`` (most wanted first) that are not resident, into
        slots that are free or hold evictable experts, without waiting; stops when no slot is
        left. ``next_step``: the experts are for the layer's next step (a prediction made in an
        earlier layer) rather than for a later pass of this one; ``keep``: further experts not
        to evict (predicted too, but beyond what is loaded). Returns the loads issued."""
        issued, protect = 0, set(experts) | set(keep)
        for e in experts:
            if e in self._slot_of:
                continue
            slot = self._victim_slot(protect=protect)
            if slot is None:
                break
            self._load(slot, e, priority, prefetched=next_step,
                       step=self._step + 1 if next_step else self._step)
            self.stats.prefetches += 1
            issued += 1
        return issued

    def hint(self, experts: list) -> None:
        """``experts`` may be needed after the next step (a prediction two layers ahead): the
        tier may start reading those that are not resident, without a slot or a load."""
        if not self.tier.takes_hints:
            return
        names = list(self.spec.shapes)
        for e in experts:
            if e not in self._slot_of:
                self.loader.hint(lambda e=e: self.tier.hint(self.layer, e, names))

    def _victim_slot(self, protect):
        """A free slot, else the policy's victim among slots that are neither pinned nor hold an
        expert in ``protect`` or needed by the current step; None if there is none."""
        candidates = []
        for slot, e in enumerate(self._expert):
            if self._pins[slot]:
                continue
            if e is None:
                return slot
            if e not in self._reserved and e not in protect:
                candidates.append(e)
        if not candidates:
            return None
        e = self.policy.victim(candidates)
        slot = self._slot_of.pop(e)
        self._expert[slot] = None
        return slot

    def _load(self, slot: int, expert: int, priority: int, prefetched: bool, step: int) -> None:
        self._gen[slot] += 1
        gen = self._gen[slot]
        evicted = self._mapped_out[slot]
        self._expert[slot] = expert
        self._slot_of[expert] = slot
        self._prefetched[slot] = prefetched
        nbytes, names = self._nbytes, self._names
        if self.mapped:
            views = self.tier.views(self.layer, expert, names)
            for name in names:
                self.slot_weights[name][slot] = views[name]
            self._mapped_out[slot] = expert
        else:
            dst = {name: t[slot] for name, t in self.slots.items()}

        def advise() -> None:
            if self._gen[slot] == gen:
                self.tier.advise(self.layer, expert, names)

        def job(non_blocking: bool) -> None:
            if evicted is not None and evicted not in self._slot_of:
                # the pages of the expert this slot held leave the resident set
                self.tier.unmap(self.layer, evicted, names)
            if self._gen[slot] != gen:
                # the slot was given to another expert before this load started
                self.tier.discard(self.layer, expert, names)
                return
            if self.mapped:
                self.tier.map_in(self.layer, expert, names)
            else:
                with torch.no_grad():  # grad mode is per thread: the loader's is on
                    self.tier.read_into(self.layer, expert, dst, non_blocking)
            with self._lock:
                s = self.stats
                s.loads += 1
                s.bytes_moved += nbytes
                self._reads[(step, expert)] += 1
                s.max_reads_per_step = max(s.max_reads_per_step, self._reads[(step, expert)])

        self._ticket[slot] = self.loader.submit(job, priority, slot_key=(id(self), slot),
                                                advise=advise if self.tier.takes_advice else None)

    def stacked(self, slots: list):
        """The weights of ``slots`` as ``[n, ...]`` tensors for the fused op, and the index of
        each slot in them: the slot tensors themselves when copied; stacked from the mapping
        (a copy) when mapped."""
        if not self.mapped:
            return self.slots, list(slots)
        return ({name: torch.stack([w[s] for s in slots]) for name, w in self.slot_weights.items()},
                list(range(len(slots))))

    def budget_bytes(self) -> int:
        """Bytes of the experts the cache holds at most (its slots)."""
        return self.num_slots * self.spec.nbytes()

    def close(self) -> None:
        """Drops the views of the mapping (the file can then be unmapped)."""
        self.drain()
        if self.mapped:
            self.slot_weights = {name: [None] * self.num_slots for name in self.spec.shapes}

    def drain(self) -> None:
        """Waits for every pending load (e.g. before timing or closing)."""
        for slot, ticket in enumerate(self._ticket):
            if ticket is not None:
                self._ticket[slot] = None
                self.loader.wait(ticket)

    def _check_frozen(self) -> None:
        for name, t in self.slots.items():
            if t.requires_grad:
                raise RuntimeError(
                    f"expert cache of layer {self.layer!r}: the expert weights of an expert store "
                    f"are frozen, but slots[{name!r}] requires grad; train the router, the shared "
                    "experts and the rest of the model, or keep the experts resident "
                    "(load_experts) to train them")

    def reset_stats(self) -> None:
        self.drain()
        self.stats = CacheStats()
