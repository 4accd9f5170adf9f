"""When to save: fixed and adaptive intervals, the cost of a save. Pure numbers, no I/O."""
