"""The checkpoint interval that minimises expected wasted time: Young (1974) and Daly (2006).

With ``d`` the cost of one checkpoint to the training, ``M`` the mean time between failures and ``R``
the time a restart takes, Daly's higher-order optimum (FGCS 22(3), 2006) is

    tau = sqrt(2 d M) * [1 + (1/3) sqrt(d / 2M) + (1/9) (d / 2M)] - d     for d < 2M,   else  tau = M

and Young's first-order one is ``sqrt(2 d M)``. The expected wall time of ``T`` seconds of work saved
every ``tau`` seconds is ``M e^(R/M) (e^((tau + d)/M) - 1) T / tau`` (Daly's eq. 13); the waste is the
fraction of wall time that is not useful work. All times are in seconds.

Example:
    >>> round(daly_interval(cost=300, mtbf=24 * 3600) / 60)    # Daly's published figure: 117 min
    117
    >>> round(young_interval(cost=300, mtbf=6 * 3600) / 60)
    60
    >>> round(100 * expected_waste(interval=3600, cost=300, mtbf=6 * 3600), 1)
    15.8
"""

from __future__ import annotations

import math


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 d M)``."""
    _check(cost, mtbf)
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum (compute time between checkpoints)."""
    _check(cost, mtbf)
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def expected_waste(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected fraction (0..1) of wall time not spent on useful work, saving every ``interval``."""
    _check(cost, mtbf)
    if interval <= 0:
        raise ValueError(f"interval={interval}: must be positive")
    exponent = (interval + cost) / mtbf
    if exponent > 700:  # the job (almost) never finishes a segment
        return 1.0
    wall_per_work = mtbf * math.exp(restart / mtbf) * math.expm1(exponent) / interval
    return 1.0 - 1.0 / wall_per_work


def _check(cost: float, mtbf: float) -> None:
    if cost < 0:
        raise ValueError(f"cost={cost}: must be >= 0 seconds")
    if mtbf <= 0:
        raise ValueError(f"mtbf={mtbf}: must be positive seconds")
