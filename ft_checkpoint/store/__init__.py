"""Storage, the bottom layer: where bytes live and how they get there intact.

- ``storage``: ``Storage``, a checkpoint directory as a URL (local disk, ``memory://``, GCS, S3, any fsspec
  protocol): read, write, list, delete, the store's own CRC-32C compared after an upload;
- ``retry``, ``client_retries``: transient errors retried with backoff, in our calls and in the clients';
- ``checksum``: CRC-32C as the bytes go by; ``buffer_pool``: buffers reused to join a small file's pieces;
- ``fence``: a save's files created only while the job holds the directory, never over another writer's;
- ``nofollow``: deletes and reads that never follow a symbolic link; ``memory_fs``: the ``memory://`` store;
- ``jsonfile``: small JSON control files, strictly parsed.

May import: ``errors``, ``units`` (never torch: the CLI reads and verifies checkpoints without it).
"""
