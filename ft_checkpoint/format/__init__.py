"""The on-disk format: step directories, the manifest, shard files, tensor metadata, signatures."""
