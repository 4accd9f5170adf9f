"""The on-disk format: what a step directory holds and how it is checked.

- ``layout``: step directory names, the manifest (the commit marker, written last) and ``check_step``;
- ``shards``: the shard files (DCP's storage writer and reader, CRC-32C per chunk as it is written and read);
- ``tensor_metadata``: DCP's metadata as JSON (nothing unpickled); ``legacy``: format 1 (a pickle, allowlisted);
- ``torch_file``: files ``torch.save`` wrote, checked before ``torch.load`` (no inflated record, no declared size);
- ``signing``: HMAC-signed manifests; ``_dcp_internals``: the private DCP names relied on, in one place.

May import: ``store``, ``progress``, ``units``, ``errors``.
"""
