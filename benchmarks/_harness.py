"""Small timing and reporting helpers shared by the benchmarks.

The machines these benchmarks run on are shared and noisy, so every comparison
runs all implementations in one process, interleaved round-robin, and reports
medians and ratios rather than absolute numbers from separate runs.
"""

from __future__ import annotations

import csv
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Entry",
    "SavedBytes",
    "environment_header",
    "format_table",
    "interleaved",
    "time_once",
    "write_csv",
]


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------


def _preloaded_allocators() -> list[str]:
    """Names of alternative allocators mapped into this process.

    LD_PRELOAD may name a wrapper script or a path without the library's
    usual name, so also look at what the dynamic loader actually mapped.
    """
    found = set()
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    sources = (maps, os.environ.get("LD_PRELOAD", ""))
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if any(name in s for s in sources):
            found.add(name)
    return sorted(found)


def environment_header() -> list[str]:
    """Lines describing what the numbers depend on: torch build, CPU, allocator."""
    malloc_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
    allocators = _preloaded_allocators()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [
        f"load average (1 min) at start: {load:.2f} on {os.cpu_count()} CPUs; another busy "
        "process distorts every number below",
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs",
        f"allocator: {', '.join(allocators) if allocators else 'glibc malloc (nothing preloaded)'}; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or '(unset)'}; "
        f"MALLOC_* = {malloc_vars if malloc_vars else '(none set)'}",
    ]


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def time_once(fn: Callable[[], object]) -> float:
    """Wall time of one call in seconds (CPU only, so no synchronisation)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Entry:
    """One implementation taking part in an interleaved comparison.

    ``fn`` is timed. ``reset`` runs untimed after every call; it is where
    gradients are set to None, so that freeing them is not charged to the
    next implementation in the round.
    ``reps``/``warmup`` override the comparison-wide counts, so a very slow
    implementation can take fewer samples without holding the fast ones back.
    """

    name: str
    fn: Callable[[], object]
    reset: Callable[[], None] | None = None
    reps: int | None = None
    warmup: int | None = None
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def _call(entry: Entry) -> float:
    t = time_once(entry.fn)
    if entry.reset is not None:
        entry.reset()
    return t


def interleaved(entries: Sequence[Entry], reps: int, warmup: int) -> None:
    """Fill ``entry.times`` by running the entries round-robin.

    Each repetition visits every entry once, starting from a rotating offset,
    so slow drift of the machine (thermal, neighbours) and any first-in-round
    effect are spread evenly over the implementations.
    """
    gc.collect()
    max_warmup = max((e.warmup if e.warmup is not None else warmup) for e in entries)
    for i in range(max_warmup):
        for e in entries:
            if i < (e.warmup if e.warmup is not None else warmup):
                _call(e)
    max_reps = max((e.reps if e.reps is not None else reps) for e in entries)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(max_reps):
            n = len(entries)
            for j in range(n):
                e = entries[(i + j) % n]
                if i < (e.reps if e.reps is not None else reps):
                    e.times.append(_call(e))
    finally:
        if gc_was_enabled:
            gc.enable()


# --------------------------------------------------------------------------
# Bytes saved for backward
# --------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class SavedBytes:
    """Counts the distinct storages autograd saves for backward.

    Use as a context manager around a forward pass. Each storage is counted
    once, keyed by (data_ptr, nbytes) of its untyped storage, so several views
    of one buffer count once. Storages of ``inputs`` (weights, x, ...) are
    reported separately: they are alive anyway, so they cost nothing extra.

    Tensors a custom autograd.Function stashes on ``ctx`` as attributes instead
    of ``save_for_backward`` bypass these hooks and are not counted.
    """

    def __init__(self, inputs: Iterable[torch.Tensor]):
        self._input_keys = {_storage_key(t) for t in inputs}
        # key -> (nbytes, is_floating)
        self._seen: dict[tuple[int, int], tuple[int, bool]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        self._seen.setdefault(key, (key[1], t.is_floating_point()))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def totals(self, float_scale: float = 1.0) -> tuple[float, float]:
        """(all saved bytes, saved bytes excluding input storages).

        ``float_scale`` rescales floating-point storages, to convert a
        measurement taken in one dtype to another dtype's element size.
        """
        total = activations = 0.0
        for key, (nbytes, is_float) in self._seen.items():
            b = nbytes * (float_scale if is_float else 1.0)
            total += b
            if key not in self._input_keys:
                activations += b
        return total, activations


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Plain-text table with right-aligned columns."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    """Write ``rows`` (dicts, possibly with different keys) as one CSV file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after freeing the autograd graphs' reference cycles.

    The cycles hold tensors of the functional collectives; freed at exit instead, from gloo's
    worker threads, they abort the process now and then ("terminate called without an active
    exception", seen in about one EP run in four on torch 2.13). The barrier keeps a rank from
    tearing the group down while another still exchanges.
    """
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
