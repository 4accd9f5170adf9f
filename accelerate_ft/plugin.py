"""The plugin dataclass: checkpoint settings the Accelerate way, from arguments, env vars or a YAML file.

Like Accelerate's ``FullyShardedDataParallelPlugin`` (which falls back to ``FSDP_*``), every field
left at None is filled in ``__post_init__`` from ``FT_CHECKPOINT_<FIELD>`` env vars, then from the
YAML file named by ``FT_CHECKPOINT_CONFIG``. That is how ``accelerate launch`` passes settings to a
script without a code change::

    FT_CHECKPOINT_DIRPATH=s3://bucket/run FT_CHECKPOINT_INTERVAL=500 \\
        accelerate launch --multi_gpu --num_processes 2 train.py

Accelerate's own config file rejects unknown keys, so ours is a separate file (see
``examples/accelerate_ft.yaml``). Parsing and validation are the core's
(:meth:`ft_checkpoint.CheckpointConfig.from_env`); this class only gives them Accelerate's shape.

Example:
    >>> plugin = FaultTolerantCheckpointPlugin(dirpath="/tmp/ft-doc/run", interval=200)
    >>> plugin.interval, plugin.keep_last
    (200, 3)
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from ft_checkpoint import CheckpointConfig
from ft_checkpoint.config import FIELDS, check_names

SETTINGS = FIELDS
"""The names a plugin (and ``FaultTolerantCheckpoint``) takes: the fields of ``CheckpointConfig``, in order."""


@dataclasses.dataclass(kw_only=True)
class FaultTolerantCheckpointPlugin:
    """Settings of :class:`~accelerate_ft.FaultTolerantCheckpoint`; None means "from env or file".

    Its fields are those of :class:`ft_checkpoint.CheckpointConfig` (documented there, with their defaults),
    in the same order and with the same types, each defaulting to None: ``dirpath``, ``interval``,
    ``keep_last``, ``storage_options``, ``async_save``, ``final_save``, ... (a test keeps them in step). After
    construction every field holds its resolved value (explicit > ``FT_CHECKPOINT_<FIELD>`` env var > the file
    in ``FT_CHECKPOINT_CONFIG`` > default), and ``config`` the validated core config.

    Example:
        >>> import os
        >>> os.environ["FT_CHECKPOINT_DIRPATH"] = "/tmp/ft-doc/from-env"
        >>> FaultTolerantCheckpointPlugin().dirpath
        '/tmp/ft-doc/from-env'
        >>> FaultTolerantCheckpointPlugin(dirpath="/tmp/ft-doc/explicit").dirpath   # explicit wins
        '/tmp/ft-doc/explicit'
        >>> del os.environ["FT_CHECKPOINT_DIRPATH"]
    """

    dirpath: str | None = None
    interval: int | datetime.timedelta | str | None = None
    min_interval: float | str | datetime.timedelta | None = None
    max_interval: float | str | datetime.timedelta | None = None
    mtbf: float | str | datetime.timedelta | None = None
    gpu_failure_rate: float | None = None
    keep_last: int | None = None
    keep_every_n_steps: int | None = None
    storage_options: dict[str, Any] | None = None
    async_save: bool | None = None
    final_save: bool | None = None
    save_rng_state: bool | None = None
    verify_checksums: bool | None = None
    retries: int | None = None
    progress_interval: float | str | datetime.timedelta | None = None
    force_takeover: bool | None = None
    on_save_error: str | None = None
    preemption_signals: tuple[str, ...] | list[str] | str | None = None
    requeue: bool | None = None
    end_time_margin: float | str | datetime.timedelta | None = None
    preemption_exit_code: int | None = None
    writer: str | None = None
    writer_priority: int | None = None
    writers: int | None = None
    lazy_snapshot: bool | None = None
    signing_key: str | None = dataclasses.field(default=None, repr=False)
    signing_key_file: str | None = None
    run_name: str | None = None
    fast_dirpath: str | None = None
    fast_interval: int | datetime.timedelta | str | None = None
    fast_replicas: int | None = None
    node_id: str | None = None

    config: CheckpointConfig = dataclasses.field(init=False, repr=False)
    """The resolved, validated core config."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FaultTolerantCheckpointPlugin:
        check_names(kwargs)  # before the dataclass's __init__, whose TypeError names no close field
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self.config = CheckpointConfig.from_env(**{name: getattr(self, name) for name in SETTINGS})
        for name in SETTINGS:
            setattr(self, name, getattr(self.config, name))

    def manager_kwargs(self) -> dict[str, Any]:
        """The resolved settings as keyword arguments of :class:`ft_checkpoint.CheckpointManager`."""
        return {name: getattr(self.config, name) for name in SETTINGS}
