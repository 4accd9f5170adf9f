"""When to save: small policy objects the manager asks at each step boundary (pure numbers, no I/O).

- ``policy``: ``SavePolicy`` and the fixed ones (``EveryNSteps``, ``EveryInterval``, ``OnPreemption``, ``AnyOf``);
- ``adaptive``: the adaptive interval (Daly's optimum from the measured save cost and the learned failure rate),
  and the multi-level plan of a fast and a durable tier;
- ``interval``: an ``interval`` setting made into a policy, and the interval in words (one description for
  the start line, the Lightning callback and the logged figures); ``cost``: a save's cost to the training.

May import: ``config``, ``format``, ``store``, ``progress``, ``units``, ``errors``; not ``run`` (side by side).
"""
