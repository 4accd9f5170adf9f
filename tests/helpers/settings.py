"""The check that keeps an integration's keyword arguments in step with ``CheckpointConfig`` (issue 22)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Any

from ft_checkpoint import CheckpointConfig


def assert_takes_every_setting(fn: Callable[..., Any]) -> None:
    """``fn`` takes each field of ``CheckpointConfig`` as a keyword argument, in the config's order, typed as the
    field or None, defaulting to None ("from the environment, the file, else the default"), so that
    LightningCLI/jsonargparse, IDEs and ``help()`` see them."""
    fields = [f.name for f in dataclasses.fields(CheckpointConfig)]
    params = inspect.signature(fn).parameters
    assert [name for name in params if name in fields] == fields, f"{fn.__qualname__} misses or reorders settings"
    expected = typing.get_type_hints(CheckpointConfig)
    for name in fields:
        hint = params[name].annotation  # a string (postponed annotations): evaluated where fn is defined
        hint = eval(hint, vars(inspect.getmodule(fn))) if isinstance(hint, str) else hint
        assert hint == expected[name] | None, f"{fn.__qualname__}({name}: {hint})"
        assert params[name].default is None, f"{fn.__qualname__}({name}={params[name].default!r})"
