"""The checkpoint intervals of two tiers: the fast tier every ``T``, every ``k``-th of its saves durable.

The model. Failures come as independent Poisson processes, one per failure class. A step on the fast tier
survives some classes (a process crash; with peer copies, also the loss of one node): their rate together is
``fast_rate``. The rest need the durable tier: ``durable_rate``. The job computes for ``T`` seconds, then saves
to the fast tier (cost ``c``, what the save costs the training); every ``k``-th save goes to the durable tier
instead (cost ``d``, measured as the manager makes it: staged once, written to both tiers). A failure the fast
tier survives loses the work since the newest step of either tier; any other failure, the work since the newest
durable step; each costs a restart of ``R``. Durable steps are nested in the fast tier's (the durable interval
is ``k T``): a durable step then protects against every failure, so it also stands in for a fast save.

To first order (Benoit et al., IEEE TC 2017) the waste of the pattern is
``((k-1) c + d) / (k T) + fast_rate T / 2 + durable_rate k T / 2``, whose optimum over ``T`` and ``k`` is
``sqrt(2 c fast_rate) + sqrt(2 (d - c) durable_rate)``, at ``k = sqrt((d - c) fast_rate / (c durable_rate))``.
Independent intervals (each tier its own Daly optimum, not aligned) do no better to that order:
``sqrt(2 c fast_rate) + sqrt(2 d durable_rate)``, since their durable saves replace no fast save. The
plan uses the exact expected time of the pattern (:func:`pattern_waste`, Daly's eq. 13 generalised: a
renewal argument over its ``k`` segments, with failures during a restart restarting it), minimised over ``T``
for each ``k`` and over ``k`` (the waste is unimodal in both).

Example:
    >>> p = plan_tiers(fast_cost=1.0, durable_cost=600.0, fast_rate=1 / 3600, durable_rate=1 / 14400)
    >>> round(p.fast_interval), p.every, round(p.durable_interval / 60)    # every 73 s; 1 in 53 durable: 64 min
    (73, 53, 64)
    >>> round(100 * p.expected_waste, 1), round(100 * p.durable_alone, 1)  # against the durable tier alone
    (29.1, 51.5)
    >>> round(100 * (math.sqrt(2 * 1 / 3600) + math.sqrt(2 * 599 / 14400)), 1)   # first order
    31.2
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ft_checkpoint.adaptive.interval import daly_interval, expected_waste

MAX_EVERY = 100_000
"""The most fast-tier saves between two durable ones that a plan considers."""
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """The two tiers' intervals (seconds of training between saves) and the waste expected with them."""

    fast_interval: float
    every: int | None
    """Every how many saves one goes to the durable tier (None: none, when no failure needs it)."""
    expected_waste: float
    """The expected fraction (0..1) of wall time not spent on useful work, with this plan."""
    durable_alone: float
    """The expected waste of the durable tier alone, at Daly's optimum for every failure."""
    durable_alone_interval: float

    @property
    def durable_interval(self) -> float:
        """Seconds between durable saves: ``every * fast_interval`` (inf: none)."""
        return math.inf if self.every is None else self.every * self.fast_interval


def pattern_waste(fast_interval: float, every: int | None, *, fast_cost: float, durable_cost: float,
                  fast_rate: float, durable_rate: float, restart: float = 0.0) -> float:
    """The expected waste (0..1) of computing ``fast_interval`` seconds between saves, every ``every``-th durable
    (None: never), under the model of the module's docstring.

    Example:
        >>> w = pattern_waste(3600, 1, fast_cost=1, durable_cost=300, fast_rate=0, durable_rate=1 / 21600)
        >>> round(100 * w, 2) == round(100 * expected_waste(3600, 300, 21600), 2)   # one tier: Daly's eq. 13
        True
    """
    _check(fast_interval=fast_interval, fast_cost=fast_cost, durable_cost=durable_cost, fast_rate=fast_rate,
           durable_rate=durable_rate, restart=restart)
    if every is None:  # never durable: a failure the fast tier does not survive loses everything
        return 1.0 if durable_rate > 0 else _waste(fast_interval, 1, fast_cost, fast_cost, fast_rate, 0.0, restart)
    return _waste(fast_interval, every, fast_cost, durable_cost, fast_rate, durable_rate, restart)


def _waste(t: float, k: int, c: float, d: float, fast_rate: float, durable_rate: float, restart: float) -> float:
    """:func:`pattern_waste` of valid numbers and a finite ``k``."""
    rate = fast_rate + durable_rate
    work = k * t
    if rate == 0:
        return 1 - work / (work + (k - 1) * c + d)
    if rate * (t + max(c, d) + restart) > 700:
        return 1.0  # (almost) no segment ever completes
    restart_time = math.expm1(rate * restart) / rate  # failures during a restart restart it
    a, g, shrink = _segment(t + c, fast_rate, durable_rate, restart_time)
    a_last, _, _ = _segment(t + d, fast_rate, durable_rate, restart_time)
    # E_j = a + (1 - g) E_(j+1) + g E_1 over the k-1 fast segments, E_k = a_last + g_last E_1, and 1 - g = p / u:
    # E_1 = (a ((p/u)^-(k-1) - 1) / g + a_last) u_last / p_last
    if g == 0 or k == 1:
        repeats = float(k - 1)
    else:
        grow = (k - 1) * shrink
        if grow > 700:
            return 1.0
        repeats = math.expm1(grow) / g
    x_last = rate * (t + d)
    u_last = 1 - -math.expm1(-x_last) * fast_rate / rate
    return max(0.0, 1 - work * math.exp(-x_last) / u_last / (a * repeats + a_last))


def _segment(length: float, fast_rate: float, durable_rate: float, restart_time: float) -> tuple[float, float, float]:
    """For a segment of ``length`` seconds (work and save): ``(a, g, -log(1 - g))`` of the recursion
    ``E = a + (1 - g) E_next + g E_first``, where ``1 - g = p / u``, ``p`` the chance that the segment completes and
    ``1 - u`` the chance of a failure that repeats only this segment."""
    rate = fast_rate + durable_rate
    x = rate * length
    p, q = math.exp(-x), -math.expm1(-x)
    lost = _lost(x) / rate  # the expected time lost to a failure within the segment, times its chance
    u = 1 - q * fast_rate / rate
    return (p * length + lost + q * restart_time) / u, q * durable_rate / rate / u, x + math.log(u)


def _lost(x: float) -> float:
    """``1 - e^-x (1 + x)``, accurate for small ``x``."""
    if x < 1e-3:
        return x * x / 2 - x ** 3 / 3 + x ** 4 / 8
    return -math.expm1(-x) - x * math.exp(-x)


def plan_tiers(*, fast_cost: float, durable_cost: float, fast_rate: float, durable_rate: float, restart: float = 0.0,
               min_fast: float = 0.0, min_durable: float = 0.0, max_durable: float = math.inf) -> TierPlan:
    """The plan that minimises :func:`pattern_waste`: the fast tier's interval at least ``min_fast``, the durable
    tier's from ``min_durable`` to ``max_durable`` (each never shorter than a save of that tier takes to commit).

    Example:
        >>> p = plan_tiers(fast_cost=1, durable_cost=60, fast_rate=0, durable_rate=1 / 3600)   # no use for it
        >>> p.every, round(p.expected_waste, 6) == round(p.durable_alone, 6)
        (1, True)
    """
    _check(fast_interval=1.0, fast_cost=fast_cost, durable_cost=durable_cost, fast_rate=fast_rate,
           durable_rate=durable_rate, restart=restart, min_fast=min_fast, min_durable=min_durable)
    total = fast_rate + durable_rate
    if total <= 0:
        raise ValueError("no failures at all: the best interval is as long as the job (give a failure rate > 0)")
    alone = min(max(daly_interval(durable_cost, 1 / total), min_durable, 1e-9), max_durable)
    durable_alone = expected_waste(alone, durable_cost, 1 / total, restart)
    if durable_rate == 0 and max_durable == math.inf:
        t = max(daly_interval(fast_cost, 1 / fast_rate), min_fast, 1e-9)
        return TierPlan(t, None, _waste(t, 1, fast_cost, fast_cost, fast_rate, 0.0, restart), durable_alone, alone)

    def best_interval(k: int) -> tuple[float, float]:
        """``(T, waste)`` minimising the waste for this ``k`` within the bounds."""
        lo, hi = max(min_fast, min_durable / k, 1e-9), max(max_durable / k, min_fast, min_durable / k, 1e-9)
        first = math.sqrt(2 * ((k - 1) * fast_cost + durable_cost) / k / (fast_rate + k * durable_rate))
        x = _bracketed(lambda x: _waste(math.exp(x), k, fast_cost, durable_cost, fast_rate, durable_rate, restart),
                       math.log(first), 4.0, math.log(lo), math.log(hi), tol=1e-3)
        return math.exp(x), _waste(math.exp(x), k, fast_cost, durable_cost, fast_rate, durable_rate, restart)

    first_k = math.sqrt(max(durable_cost - fast_cost, 0.0) * fast_rate / max(fast_cost * durable_rate, 1e-300))
    k = _argmin_int(lambda k: best_interval(k)[1], min(max(first_k, 1.0), MAX_EVERY))
    t, w = best_interval(k)
    return TierPlan(t, k, w, durable_alone, alone)


def _bracketed(f: Callable[[float], float], guess: float, width: float, lo: float, hi: float, tol: float) -> float:
    """The minimum of a unimodal ``f`` on ``[lo, hi]``, searched within ``width`` of ``guess`` first (a factor in
    ``log`` terms), then, if it lies on that bracket's edge, on all of ``[lo, hi]``."""
    a, b = max(lo, guess - math.log(width)), min(hi, guess + math.log(width))
    if a >= b:
        return min(max(guess, lo), hi)
    x = _golden(f, a, b, tol)
    if (x - a < 2 * tol and a > lo) or (b - x < 2 * tol and b < hi):
        x = _golden(f, max(lo, guess - 50), min(hi, guess + 50), tol)
    return x


def _golden(f: Callable[[float], float], a: float, b: float, tol: float = 1e-4) -> float:
    """The minimum of a unimodal ``f`` on ``[a, b]`` by golden-section search."""
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


def _argmin_int(f: Callable[[int], float], guess: float) -> int:
    """The integer ``k`` in 1..MAX_EVERY minimising a unimodal ``f``: a search on ``log k`` around ``guess``, then
    the neighbours."""
    cache: dict[int, float] = {}

    def at(k: int) -> float:
        k = min(max(k, 1), MAX_EVERY)
        if k not in cache:
            cache[k] = f(k)
        return cache[k]

    k = round(math.exp(_bracketed(lambda x: at(round(math.exp(x))), math.log(guess), 8.0, 0.0, math.log(MAX_EVERY),
                                  tol=0.02)))
    while k < MAX_EVERY and at(k + 1) < at(k):
        k += 1
    while k > 1 and at(k - 1) < at(k):
        k -= 1
    return k


def _check(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r}: must be a finite number >= 0")
    if values["fast_interval"] <= 0:
        raise ValueError(f"fast_interval={values['fast_interval']!r}: must be positive")
