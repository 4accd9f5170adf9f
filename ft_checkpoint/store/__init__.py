"""Where bytes live: local disk, memory://, GCS, S3 (fsspec), retries, checksums. Never imports torch."""
