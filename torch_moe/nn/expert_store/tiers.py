"""The slow tier of an expert store: where every expert of every layer lives.

Two tiers behind one interface, :class:`SlowTier`:

* :class:`FileTier`: a safetensors file, memory-mapped (the CPU tier). A CPU cache holds an
  expert as its pages of the mapping, made resident when it is loaded and unmapped when it is
  evicted (the resident set holds the cache, not the file); a GPU cache copies the pages into
  its slots and unmaps them. With ``drop_page_cache`` the pages leave the page cache too, so
  that every load reads the disk (a file larger than RAM). Where the page cache can hold large
  folios (transparent huge pages on; XFS, or ext4 from Linux 6.16) the mapping is advised huge
  pages (``MADV_HUGEPAGE``, but for a file larger than RAM): a load's page fault reads the file
  into the page cache in PMD-sized folios, two at a time, which map in and out with a fraction
  of the kernel's work per page. Elsewhere loads queued behind the current one are announced to
  the kernel (``POSIX_FADV_WILLNEED``, which reads into single-page folios), which reads them
  ahead.
* :class:`HostTier`: host tensors, pinned when the cache lives on a GPU (the GPU tier): copies
  from pinned memory to the device are asynchronous DMA on a side stream.

An expert is a set of named tensors (``w1 [D, F]``, ``w3 [D, F]``, ``w2 [F, D]``, optional
biases), described by an :class:`ExpertSpec`. File keys are ``{layer}.experts.{e}.{name}``
(``experts.{e}.{name}`` for an unnamed layer): one expert's tensors are adjacent in the file,
so that a load is one sequential read.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from torch_moe.nn.expert_store._format import SafetensorsFile

__all__ = ["ExpertSpec", "expert_key", "SlowTier", "FileTier", "HostTier"]

# the per-expert tensors of a GroupedExperts, in file order
EXPERT_TENSORS = ("w1", "w3", "w2", "b1", "b3", "b2")


@dataclass(frozen=True)
class ExpertSpec:
    """The tensors of one expert: ``shapes[name]`` (without the expert dim) and their dtype."""

    num_experts: int
    shapes: dict
    dtype: torch.dtype

    @classmethod
    def of(cls, experts) -> "ExpertSpec":
        """The spec of a :class:`~torch_moe.nn.GroupedExperts` (its present weights)."""
        shapes = {}
        for name in EXPERT_TENSORS:
            w = getattr(experts, name, None)
            if w is not None:
                shapes[name] = tuple(w.shape[1:])
        return cls(experts.w1.size(0), shapes, experts.w1.dtype)

    def nbytes(self) -> int:
        """Bytes of one expert."""
        total = 0
        for shape in self.shapes.values():
            n = 1
            for s in shape:
                n *= s
            total += n * self.dtype.itemsize
        return total


# ATen's intra-op grain (at::internal::GRAIN_SIZE): a CPU copy of at most this many elements
# runs on the calling thread without an OpenMP team
_SERIAL_COPY_ELEMENTS = 32768


def copy_into(dst: Tensor, src: Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``; a CPU copy runs in pieces small enough to stay on the calling thread.

    The loader thread copies while the compute thread runs its own OpenMP team on every core: a
    copy large enough to be parallelised would start a second team and oversubscribe the cores
    (measured: decode with prefetch at 3/4 of the speed of decode without it, on 2 cores).
    """
    if dst.device.type != "cpu" or dst.numel() <= _SERIAL_COPY_ELEMENTS:
        dst.copy_(src, non_blocking=non_blocking)
        return
    d, s = dst.view(-1), src.reshape(-1)
    for i in range(0, d.numel(), _SERIAL_COPY_ELEMENTS):
        d[i : i + _SERIAL_COPY_ELEMENTS].copy_(s[i : i + _SERIAL_COPY_ELEMENTS])


def expert_key(layer: str, expert: int, name: str) -> str:
    return f"{layer}.experts.{expert}.{name}" if layer else f"experts.{expert}.{name}"


class SlowTier:
    """Where the experts live. ``read_into(layer, e, dst)`` copies expert ``e`` of ``layer`` into
    ``dst`` (name -> tensor of the spec's shape, a cache slot), with ``non_blocking`` where the
    copy can be asynchronous (pinned host to GPU).

    A tier with ``maps_experts`` can instead hand out views of an expert in CPU memory that it
    makes resident on demand (``views``, ``map_in``, ``unmap``): a CPU cache then holds experts
    in place rather than copies of them (see :mod:`torch_moe.nn.expert_store.cache`)."""

    maps_experts = False
    # whether advise() / hint() read anything ahead (a caller may then skip giving them)
    takes_advice = False
    takes_hints = False

    def views(self, layer: str, expert: int, names) -> dict:
        """name -> the expert's tensor, read where it lies (not resident until ``map_in``)."""
        raise NotImplementedError

    def map_in(self, layer: str, expert: int, names) -> None:
        """Makes the expert's bytes resident behind its views (blocks until they are)."""
        raise NotImplementedError

    def unmap(self, layer: str, expert: int, names) -> None:
        """The expert's bytes may leave memory (its views stay valid: a read maps them in)."""
        raise NotImplementedError

    def check_layer(self, layer: str, spec: ExpertSpec) -> None:
        raise NotImplementedError

    def read_into(self, layer: str, expert: int, dst: dict, non_blocking: bool = False) -> None:
        raise NotImplementedError

    def advise(self, layer: str, expert: int, names) -> None:
        """Expert ``expert`` of ``layer`` (its tensors ``names``) will be read soon: start
        fetching it, without waiting. Nothing to do where the experts are in memory. Called only
        where ``takes_advice`` (a tier that reads ahead sets it)."""

    def discard(self, layer: str, expert: int, names) -> None:
        """An advised read of the expert will not happen after all."""

    def hint(self, layer: str, expert: int, names) -> None:
        """The expert may be read later (a guess): fetch it if that is cheap to be wrong about.
        Nothing to do where the experts are in memory."""

    def close(self) -> None:
        pass


class FileTier(SlowTier):
    """Experts in a safetensors file (see :func:`~torch_moe.nn.expert_store.save_experts`),
    mapped, read on demand."""

    maps_experts = True

    def __init__(self, path, drop_page_cache: bool = False):
        # PMD-sized page-cache folios, except for a file larger than RAM: dropping an expert's
        # pages from the page cache drops no folio that reaches past them
        self.file = SafetensorsFile(path, huge_pages=not drop_page_cache)
        self.drop_page_cache = drop_page_cache
        # per (layer, expert): its byte span and its views, made once (a load's bookkeeping
        # runs on the loader thread with the GIL held, so it is kept to a lookup)
        self._spans: dict = {}
        self._views: dict = {}

    def check_layer(self, layer: str, spec: ExpertSpec) -> None:
        """Every expert of ``layer`` is in the file with the spec's shapes and dtype."""
        f = self.file
        where = f"layer {layer!r}" if layer else "the (unnamed) layer"
        if not any(k in f for k in (expert_key(layer, 0, n) for n in spec.shapes)):
            raise KeyError(f"offload_experts: {f.path!r} holds no experts of {where} (no key "
                           f"{expert_key(layer, 0, 'w1')!r}); was it written by save_experts for "
                           "this model?")
        for e in range(spec.num_experts):
            for name, shape in spec.shapes.items():
                key = expert_key(layer, e, name)
                if key not in f:
                    raise KeyError(f"offload_experts: {f.path!r} misses {key!r} (expert {e} of "
                                   f"{where}, {spec.num_experts} experts expected)")
                dtype, got = f.info(key)
                if got != shape or dtype != spec.dtype:
                    raise ValueError(f"offload_experts: {key!r} in {f.path!r} is {dtype} "
                                     f"{list(got)}, but the layer expects {spec.dtype} {list(shape)}")
        extra = expert_key(layer, spec.num_experts, next(iter(spec.shapes)))
        if extra in f:
            raise ValueError(f"offload_experts: {f.path!r} holds more than the {spec.num_experts} "
                             f"experts of {where} (found {extra!r})")

    def read_into(self, layer: str, expert: int, dst: dict, non_blocking: bool = False) -> None:
        keys = [expert_key(layer, expert, name) for name in dst]
        if all(t.device.type == "cpu" for t in dst.values()):
            # straight from the file into the slots (see SafetensorsFile.read_into)
            self.file.read_into(keys, list(dst.values()))
        else:
            for key, slot in zip(keys, dst.values()):
                copy_into(slot, self.file.get(key), non_blocking)
                self.file.release(*self.file.byte_range(key))
        if self.drop_page_cache:
            self.file.release(*self._span(keys), page_cache=True)

    def _span(self, keys) -> tuple:
        """``(offset, length)`` of the bytes of ``keys`` (one expert's tensors, adjacent)."""
        ranges = [self.file.byte_range(k) for k in keys]
        lo = min(off for off, _ in ranges)
        return lo, max(off + n for off, n in ranges) - lo

    def _expert_span(self, layer: str, expert: int, names) -> tuple:
        key = (layer, expert)
        span = self._spans.get(key)
        if span is None:
            span = self._spans[key] = self._span([expert_key(layer, expert, n) for n in names])
        return span

    def views(self, layer: str, expert: int, names) -> dict:
        key = (layer, expert)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {n: self.file.get(expert_key(layer, expert, n))
                                        for n in names}
        return views

    def map_in(self, layer: str, expert: int, names) -> None:
        span = self._expert_span(layer, expert, names)
        if not self.file.huge_pages:
            # the whole expert asked of the disk at once (a no-op for pages already cached, or
            # already advised): populating alone would fault it in a readahead window at a time
            self.file.advise(*span)
        # (with huge pages a fault reads PMD-sized folios, two at a time)
        self.file.populate(*span)

    def unmap(self, layer: str, expert: int, names) -> None:
        # out of this process's resident set; with drop_page_cache out of the page cache too,
        # so that the next load reads the disk (a file larger than RAM)
        self.file.release(*self._expert_span(layer, expert, names),
                          page_cache=self.drop_page_cache)

    def advise(self, layer: str, expert: int, names) -> None:
        # POSIX_FADV_WILLNEED queues the reads of the expert's pages and returns: the kernel
        # reads them in the background, so several advised experts are in flight at once. Not
        # with huge pages: it reads into single-page folios, and they stay so (a load's fault
        # reads PMD-sized folios, two at a time; reading ahead on a thread of its own, by
        # faulting experts in through a second mapping, removed no stall)
        if not self.file.huge_pages:
            self.file.advise(*self._expert_span(layer, expert, names))

    @property
    def takes_advice(self) -> bool:
        return not self.file.huge_pages

    @property
    def takes_hints(self) -> bool:
        # not for a file larger than RAM (what a wrong guess reads would stay in the page
        # cache), nor with huge pages (see advise)
        return not self.drop_page_cache and not self.file.huge_pages

    def hint(self, layer: str, expert: int, names) -> None:
        if self.takes_hints:
            self.advise(layer, expert, names)

    def discard(self, layer: str, expert: int, names) -> None:
        if self.drop_page_cache:
            # a file larger than RAM: pages read ahead for nothing do not stay
            self.file.release(*self._expert_span(layer, expert, names), page_cache=True)

    def close(self) -> None:
        self._views = {}
        self.file.close()


class HostTier(SlowTier):
    """Experts in host memory: ``tensors[layer][name]`` of shape ``[E, *spec.shapes[name]]``,
    pinned with ``pin_memory`` (what a GPU cache needs for asynchronous copies)."""

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self.tensors: dict = {}

    @classmethod
    def from_file(cls, path, layers: dict, pin_memory: bool) -> "HostTier":
        """Reads each layer's experts (``layers``: name -> spec) from a safetensors file once."""
        tier, files = cls(pin_memory), FileTier(path)
        try:
            for layer, spec in layers.items():
                files.check_layer(layer, spec)
                stacked = {name: torch.empty((spec.num_experts, *shape), dtype=spec.dtype,
                                             pin_memory=pin_memory)
                           for name, shape in spec.shapes.items()}
                for e in range(spec.num_experts):
                    files.read_into(layer, e, {n: t[e] for n, t in stacked.items()})
                tier.tensors[layer] = stacked
        finally:
            files.close()
        return tier

    def check_layer(self, layer: str, spec: ExpertSpec) -> None:
        if layer not in self.tensors:
            raise KeyError(f"offload_experts: the host tier holds no experts of layer {layer!r}")

    def read_into(self, layer: str, expert: int, dst: dict, non_blocking: bool = False) -> None:
        src = self.tensors[layer]
        for name, slot in dst.items():
            copy_into(slot, src[name][expert], non_blocking)
