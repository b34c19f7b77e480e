"""Who loads experts from the slow tier into cache slots, and how the compute waits for it.

* :class:`ThreadLoader` (CPU): one background thread runs the loads (mapping an expert's pages
  in, or copying it), demand loads before prefetches (a priority queue). ``madvise`` (through
  ctypes), ``preadv`` and ``Tensor.copy_`` release the GIL, so a load overlaps the compute of
  the main thread. One thread: two loads never write one slot at once, and a load queued for a
  slot whose expert was evicted before it started is skipped.
  Before each copy the thread *advises* the next ``readahead`` queued loads (``advise``, for the
  file tier ``POSIX_FADV_WILLNEED`` on the expert's bytes where its page cache is of single
  pages; where it reads huge folios its loads carry no advice, and the thread looks for none):
  the kernel then reads them from the disk in the background, many requests in flight, while
  the thread copies one at a time. One read at a time reaches a fraction of what the disk gives
  with a deep queue (measured on 1.5 MiB experts read cold in random order: 0.73 GB/s one by
  one, 1.84 GB/s with 16 advised ahead).
* :class:`StreamLoader` (CUDA): copies are issued at once, ``non_blocking``, on a side stream;
  an event recorded after each copy is what the compute stream waits on (no host stall), and a
  slot is overwritten only after the compute stream has passed the event recorded when its
  last user released it.
* :class:`InlineLoader`: no prefetch; each copy runs on the calling thread when it is needed.

``submit(job, priority, slot_key, advise)`` returns a ticket; ``ready(ticket)`` says whether its
copy is done; ``wait(ticket)`` returns the seconds the calling
thread was blocked (the stall). ``released(slot_key)`` marks the point after which a slot may be
overwritten.
"""

import heapq
import itertools
import threading
import time

import torch

__all__ = ["ThreadLoader", "StreamLoader", "InlineLoader", "make_loader"]

# a step's own loads, then the prefetches for the next layer, then hints for the one after
DEMAND, NEXT_LAYER, HINT = 0, 1, 2


class _Ticket:
    """A load's completion. A lock held from submission until the load has run, rather than a
    ``threading.Event``: ``Event.set`` and ``Event.wait`` run Python (a ``Condition``) under the
    GIL on both threads for each of thousands of loads a second, where acquiring a lock blocks
    in C without the GIL and releasing it is one call."""

    __slots__ = ("_pending", "error", "seconds")

    def __init__(self):
        self._pending = threading.Lock()
        self._pending.acquire()
        self.error = None
        self.seconds = 0.0

    def set(self) -> None:
        """The load has run (called once, by the thread that ran it)."""
        self._pending.release()

    def is_set(self) -> bool:
        return not self._pending.locked()

    def wait(self) -> None:
        self._pending.acquire()
        self._pending.release()  # done for good: a later wait or is_set sees it so


class InlineLoader:
    asynchronous = False
    cancellable = False

    def submit(self, job, priority: int = DEMAND, slot_key=None, advise=None):
        ticket = _Ticket()
        start = time.perf_counter()
        job(False)
        # the copy ran here, on the compute thread: all of its time is stall
        ticket.seconds = time.perf_counter() - start
        ticket.set()
        return ticket

    def ready(self, ticket) -> bool:
        return True

    def wait(self, ticket) -> float:
        seconds, ticket.seconds = ticket.seconds, 0.0
        return seconds

    def released(self, slot_key) -> None:
        pass

    def hint(self, advise) -> None:
        pass  # nothing runs in the background to follow it

    def close(self) -> None:
        pass


class ThreadLoader:
    asynchronous = True
    cancellable = True  # a queued job that finds its slot reassigned does nothing

    def __init__(self, readahead: int = 16):
        # queued loads advised ahead of the one being copied (16 experts of 1.5 MiB keep a
        # virtual disk at its sequential bandwidth; more only holds pages for longer)
        self.readahead = readahead
        self._heap: list = []
        self._advised = 0  # queued entries whose advice has not been given
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="torch_moe-expert-loader",
                                        daemon=True)
        self._thread.start()

    def submit(self, job, priority: int = DEMAND, slot_key=None, advise=None):
        """Queues ``job``; ``advise()``, if given, tells the tier the job will read soon (called
        on this loader's thread, at most once, before the job runs)."""
        ticket = _Ticket()
        with self._cv:
            if self._closed:
                raise RuntimeError("expert store: the loader is closed (ExpertStore.close() was "
                                   "called)")
            # a list, so that the advice can be struck off once given; seq makes entries
            # unique, so the comparison never reaches the job
            heapq.heappush(self._heap, [priority, next(self._seq), job, ticket, advise])
            self._advised += advise is not None
            self._cv.notify()
        return ticket

    def hint(self, advise) -> None:
        """Queues ``advise()`` alone, behind every load: a read that may follow later (a guess
        further ahead than a load is worth a slot for). Given when it comes within
        ``readahead`` of the load being run, like a load's."""
        with self._cv:
            if not self._closed:
                heapq.heappush(self._heap, [HINT, next(self._seq), None, None, advise])
                self._advised += 1
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                entry = heapq.heappop(self._heap)
                _, _, job, ticket, _ = entry
                advice = []
                # (nothing to look for where no queued load carries advice: a tier that takes
                # none, as the file tier over huge pages)
                if self._advised:
                    for e in [entry, *heapq.nsmallest(self.readahead, self._heap)]:
                        if e[4] is not None:
                            advice.append(e[4])
                            e[4] = None  # given once
                            self._advised -= 1
            if job is None:  # a hint: its advice was all there was to it
                for advise in advice:
                    advise()
                continue
            try:
                # the advice of a load that turns out stale is harmless: pages read early
                for advise in advice:
                    advise()
                job(False)
            except BaseException as e:  # handed to the waiter, raised on the compute thread
                ticket.error = e
            ticket.set()

    def ready(self, ticket) -> bool:
        return ticket.is_set()

    def wait(self, ticket) -> float:
        if ticket.is_set():
            stall = 0.0
        else:
            start = time.perf_counter()
            ticket.wait()
            stall = time.perf_counter() - start
        if ticket.error is not None:
            error, ticket.error = ticket.error, None
            raise RuntimeError(f"expert store: loading an expert failed: {error}") from error
        return stall

    def released(self, slot_key) -> None:
        pass

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()


class StreamLoader:
    asynchronous = True
    cancellable = False  # a copy is on the stream as soon as it is submitted

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._free: dict = {}

    def submit(self, job, priority: int = DEMAND, slot_key=None, advise=None):
        # the side stream must not overwrite a slot that queued compute still reads
        free = self._free.pop(slot_key, None)
        with torch.cuda.stream(self.stream):
            if free is not None:
                self.stream.wait_event(free)
            job(True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def ready(self, ticket) -> bool:
        return ticket.query()

    def wait(self, ticket) -> float:
        torch.cuda.current_stream(self.device).wait_event(ticket)
        return 0.0  # the host does not wait: the compute stream does

    def released(self, slot_key) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._free[slot_key] = event

    def hint(self, advise) -> None:
        pass  # the host tier is in memory: nothing to read ahead

    def close(self) -> None:
        pass


def make_loader(device: torch.device, asynchronous: bool):
    """A :class:`StreamLoader` for a CUDA cache, else a :class:`ThreadLoader`; an
    :class:`InlineLoader` without ``asynchronous`` (no prefetch)."""
    if not asynchronous:
        return InlineLoader()
    if device.type == "cuda":
        return StreamLoader(device)
    return ThreadLoader()
