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

MAX_EVERY = 100_000
"""The most fast-tier saves between two durable ones that a plan considers."""
QUADRATURE = ((-math.sqrt(3), 1 / 6), (0.0, 2 / 3), (math.sqrt(3), 1 / 6))
"""Gauss-Hermite's three points (in standard deviations) and weights: an average over a normal uncertainty that is
exact for polynomials up to the 5th degree."""
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
        >>> from ft_checkpoint.policies.adaptive.interval import expected_waste
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
    """:func:`pattern_waste` of valid numbers and a finite ``k``.

    ``E_j``, the expected time from the start of the ``j``-th of the ``k`` segments (work and save) to the end of the
    pattern, is ``a + (1 - g) E_(j+1) + g E_1`` for a fast save and ``a_last + g_last E_1`` for the durable one, where
    for a segment of length ``s``, with ``x = rate s``, ``p = e^-x`` the chance it completes and
    ``u = 1 - (1 - p) fast_rate / rate``: ``a = (p s + L + (1 - p) R) / u`` (``L``: the time lost to a failure within
    it, times its chance; ``R``: the restart), ``g = (1 - p) durable_rate / (rate u)``, and ``1 - g = p / u``. So
    ``E_1 = (a ((u / p)^(k-1) - 1) / g + a_last) u_last / p_last``."""
    rate = fast_rate + durable_rate
    work = k * t
    if rate == 0:
        return 1 - work / (work + (k - 1) * c + d)
    if rate * (t + max(c, d) + restart) > 700:
        return 1.0  # (almost) no segment ever completes
    restart_time = math.expm1(rate * restart) / rate  # failures during a restart restart it
    share = fast_rate / rate
    x, x_last = rate * (t + c), rate * (t + d)
    q, q_last = -math.expm1(-x), -math.expm1(-x_last)
    u, u_last = 1 - q * share, 1 - q_last * share
    a = ((1 - q) * (t + c) + _lost(x) / rate + q * restart_time) / u
    a_last = ((1 - q_last) * (t + d) + _lost(x_last) / rate + q_last * restart_time) / u_last
    g = q * (1 - share) / u
    if g == 0 or k == 1:
        repeats = float(k - 1)
    else:
        grow = (k - 1) * (x + math.log(u))  # (k - 1) log(u / p)
        if grow > 700:
            return 1.0
        repeats = math.expm1(grow) / g
    return max(0.0, 1 - work * math.exp(-x_last) / u_last / (a * repeats + a_last))


def _lost(x: float) -> float:
    """``1 - e^-x (1 + x)``, accurate for small ``x``."""
    if x < 1e-3:
        return x * x / 2 - x ** 3 / 3 + x ** 4 / 8
    return -math.expm1(-x) - x * math.exp(-x)


def plan_tiers(*, fast_cost: float, durable_cost: float, fast_rate: float, durable_rate: float, restart: float = 0.0,
               spread: float = 0.0, min_fast: float = 0.0, min_durable: float = 0.0,
               max_durable: float = math.inf) -> TierPlan:
    """The plan that minimises the expected :func:`pattern_waste`: the fast tier's interval at least ``min_fast``, the
    durable tier's from ``min_durable`` to ``max_durable`` (each never shorter than a save of that tier takes to
    commit). ``spread``: how uncertain the rates are, the standard deviation of their log (a common factor, log-normal
    around the rates given); the waste is then averaged over it (:data:`QUADRATURE`): the Bayes decision, which saves
    more often than planning for the mean rate would where a higher rate would cost much more than a lower saves.

    Example:
        >>> p = plan_tiers(fast_cost=1, durable_cost=60, fast_rate=0, durable_rate=1 / 3600)   # no use for it
        >>> p.every, round(p.expected_waste, 6) == round(p.durable_alone, 6)
        (1, True)
        >>> unsure = plan_tiers(fast_cost=1, durable_cost=60, fast_rate=0, durable_rate=1 / 3600, spread=1.0)
        >>> unsure.fast_interval < p.fast_interval
        True
    """
    _check(fast_interval=1.0, fast_cost=fast_cost, durable_cost=durable_cost, fast_rate=fast_rate,
           durable_rate=durable_rate, restart=restart, spread=spread, min_fast=min_fast, min_durable=min_durable)
    if fast_rate + durable_rate <= 0:
        raise ValueError("no failures at all: the best interval is as long as the job (give a failure rate > 0)")
    scale = [(w, math.exp(z * spread)) for z, w in QUADRATURE] if spread > 0 else [(1.0, 1.0)]
    mean = sum(w * m for w, m in scale)

    def waste(t: float, k: int, c: float = fast_cost, d: float = durable_cost, fast: float = fast_rate,
              durable: float = durable_rate) -> float:
        return sum(w * _waste(t, k, c, d, fast * m, durable * m, restart) for w, m in scale)

    def best_interval(k: int, lo: float, hi: float, first: float, **costs: float) -> tuple[float, float]:
        """``(T, waste)`` minimising the waste for this ``k`` in ``[lo, hi]``, from the first-order ``first``."""
        lo, hi = max(lo, 1e-9), max(hi, lo, 1e-9)
        t = math.exp(_bracketed(lambda x: waste(math.exp(x), k, **costs), math.log(first), 4.0, math.log(lo),
                                math.log(hi), tol=2e-3))
        return t, waste(t, k, **costs)

    total = mean * (fast_rate + durable_rate)
    alone, durable_alone = best_interval(1, min_durable, max_durable, math.sqrt(2 * max(durable_cost, 1e-9) / total),
                                         c=durable_cost, fast=0.0, durable=fast_rate + durable_rate)
    if durable_rate == 0 and max_durable == math.inf:  # never durable
        t, w = best_interval(1, min_fast, math.inf, math.sqrt(2 * max(fast_cost, 1e-9) / total), d=fast_cost)
        return TierPlan(t, None, w, durable_alone, alone)

    def for_every(k: int) -> tuple[float, float]:
        first = math.sqrt(2 * ((k - 1) * fast_cost + durable_cost) / k / (mean * (fast_rate + k * durable_rate)))
        return best_interval(k, max(min_fast, min_durable / k), max_durable / k, first)

    first_k = math.sqrt(max(durable_cost - fast_cost, 0.0) * fast_rate / max(fast_cost * durable_rate, 1e-300))
    k = _argmin_int(lambda k: for_every(k)[1], min(max(first_k, 1.0), MAX_EVERY))
    t, w = for_every(k)
    return TierPlan(t, k, w, durable_alone, alone)


def _bracketed(f: Callable[[float], float], guess: float, width: float, lo: float, hi: float, tol: float) -> float:
    """The minimum of a unimodal ``f`` on ``[lo, hi]``, searched within ``width`` of ``guess`` first (a factor in
    ``log`` terms), then, if it lies on that bracket's edge, on all of ``[lo, hi]``."""
    a, b = max(lo, guess - math.log(width)), min(hi, guess + math.log(width))
    if a >= b:
        return min(max(guess, lo), hi)
    x = _brent(f, a, b, tol)
    if (x - a < 2 * tol and a > lo) or (b - x < 2 * tol and b < hi):
        x = _brent(f, max(lo, guess - 50), min(hi, guess + 50), tol)
    return x


def _brent(f: Callable[[float], float], a: float, b: float, tol: float = 1e-4) -> float:
    """The minimum of a unimodal ``f`` on ``[a, b]``: Brent's method (parabolic steps through the three best points,
    a golden-section step where a parabola does not help), to within ``tol``."""
    x = w = v = b - _GOLDEN * (b - a)
    fx = fw = fv = f(x)
    step = last = 0.0
    for _ in range(100):
        mid = (a + b) / 2
        if abs(x - mid) <= 2 * tol - (b - a) / 2:
            break
        r, q = (x - w) * (fx - fv), (x - v) * (fx - fw)
        p, q = (x - v) * q - (x - w) * r, 2 * (q - r)
        p, q = (-p, -q) if q > 0 else (p, q)
        q = -q
        if abs(last) > tol and abs(p) < abs(q * last / 2) and a * q < x * q + p < b * q:
            last, step = step, p / q  # a parabolic step
            if (x + step) - a < 2 * tol or b - (x + step) < 2 * tol:
                step = tol if x < mid else -tol
        else:
            last = (a if x >= mid else b) - x
            step = (1 - _GOLDEN) * last  # a golden-section step
        u = x + (step if abs(step) >= tol else (tol if step > 0 else -tol))
        fu = f(u)
        if fu <= fx:
            a, b = (a, x) if u < x else (x, b)
            v, fv, w, fw, x, fx = w, fw, x, fx, u, fu
        else:
            a, b = (u, b) if u < x else (a, u)
            if fu <= fw or w == x:
                v, fv, w, fw = w, fw, u, fu
            elif fu <= fv or v in (x, w):
                v, fv = u, fu
    return x


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
                                  tol=0.05)))
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
