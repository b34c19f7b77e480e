"""The malformed-input corpus: one ``Case`` per bad call of a public entry point.

Each ``test_malformed_<room>.py`` module lists its cases in ``CASES`` and instantiates them with
``malformed_tests(CASES)``. A case ends in exactly one of two ways:

* a clear error: ``error`` is the exception type(s) and ``needles`` the substrings its message
  must hold, which name the argument, the value expected and the value given;
* a defined result: ``check`` receives what the call returned and asserts it is right (for
  inputs that are unusual but valid, such as no rows at all).

Every call runs under a wall-clock limit (``timeout_s``), so a hang fails the case instead of the
suite. ``python test/malformed/_malformed.py`` prints the number of cases by entry point.
"""

import contextlib
import dataclasses
import importlib
import os
import signal
import sys
from collections import Counter
from typing import Any, Callable, Optional

from torch.testing._internal.common_utils import TestCase, parametrize, instantiate_parametrized_tests

__all__ = ["Case", "malformed_tests", "count_by_entry"]


@dataclasses.dataclass(frozen=True)
class Case:
    entry: str  # the public entry point, e.g. "torch_moe.token_sort"
    name: str  # what is malformed, e.g. "negative_expert_id"
    call: Callable[[], Any]
    error: Any = None  # an exception type or a tuple of them; None for a defined result
    needles: tuple = ()  # substrings the message must contain
    check: Optional[Callable[[Any], None]] = None  # asserts on the result of a valid call
    timeout_s: float = 20.0

    def __post_init__(self):
        if (self.error is None) == (self.check is None):
            raise ValueError(f"case {self.entry}/{self.name}: give exactly one of error= or check=")
        if self.error is not None and not self.needles:
            raise ValueError(f"case {self.entry}/{self.name}: an error case must name its needles")

    @property
    def id(self) -> str:
        return f"{self.entry.replace('.', '_')}__{self.name}"


class _Timeout(BaseException):
    # BaseException, so that no ``except Exception`` in the code under test swallows it
    pass


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    if not hasattr(signal, "setitimer") or os.name == "nt":
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout(f"{what} did not finish within {seconds} s (a hang?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(test: TestCase, case: Case) -> None:
    try:
        with _time_limit(case.timeout_s, f"{case.entry} ({case.name})"):
            if case.error is None:
                result = case.call()
            else:
                with test.assertRaises(case.error) as ctx:
                    case.call()
    except _Timeout as e:
        test.fail(str(e))
    if case.error is None:
        case.check(result)
        return
    message = str(ctx.exception)
    for needle in case.needles:
        test.assertIn(needle, message, f"{case.entry} ({case.name}): the error does not say "
                      f"{needle!r}; it says: {message}")


def malformed_tests(cases, name: str = "TestMalformedInput"):
    """A TestCase class with one test per case, named ``test_case_<entry>__<name>``."""
    ids = [c.id for c in cases]
    dupes = [i for i, n in Counter(ids).items() if n > 1]
    if dupes:
        raise ValueError(f"duplicate case ids: {dupes}")

    class _Cls(TestCase):
        @parametrize("case", cases, name_fn=lambda c: c.id)
        def test_case(self, case):
            run_case(self, case)

    _Cls.__name__ = _Cls.__qualname__ = name
    instantiate_parametrized_tests(_Cls)
    return _Cls


def count_by_entry(modules=None) -> Counter:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    if modules is None:
        modules = sorted(f[:-3] for f in os.listdir(here)
                         if f.startswith("test_malformed_") and f.endswith(".py"))
    counts = Counter()
    for m in modules:
        for c in importlib.import_module(m).CASES:
            counts[(c.entry, "error" if c.error is not None else "defined result")] += 1
    return counts


if __name__ == "__main__":
    counts = count_by_entry()
    entries = sorted({e for e, _ in counts})
    print(f"{'entry point':48s} {'errors':>7s} {'defined':>8s}")
    for e in entries:
        print(f"{e:48s} {counts[(e, 'error')]:7d} {counts[(e, 'defined result')]:8d}")
    print(f"{'total':48s} {sum(v for (e, k), v in counts.items() if k == 'error'):7d} "
          f"{sum(v for (e, k), v in counts.items() if k != 'error'):8d}")
