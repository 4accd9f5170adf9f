"""The GCS emulator (``gcp-storage-emulator``) as the tests run it, three of its gaps closed the way GCS behaves.

- **Idle connections time out** (``--idle-timeout``, seconds). The emulator serves one connection at a time (a
  plain ``http.server.HTTPServer``), so a client stopped while holding a keep-alive connection (SIGSTOP, as in the
  lease tests) would otherwise block every other client for good; closed, the client reconnects.
- **Objects are written atomically.** The emulator rewrites its whole index (``.meta``) in place at each change:
  killed in the middle (as the tests kill it), it left a truncated index and never started again; now written aside
  and renamed, as GCS objects are.
- **``ifGenerationMatch=0`` holds.** GCS refuses an upload with this precondition when the object exists (HTTP 412,
  ``conditionNotMet``): checked when a simple or multipart upload arrives, and for a resumable one when its last
  byte arrives (its session starts whatever the object: the precondition is the session's, and the completing request
  fails, as GCS was seen to do, googleapis/google-cloud-java#201). The emulator ignores every precondition; without
  this, a test could not tell an exclusive create (``Storage.exclusive_creates``) from a plain write.

Run as ``python .../ft_checkpoint/testing/gcs_emulator.py --idle-timeout 20 start --host 127.0.0.1 --port PORT``
(the emulator's own arguments after ``--idle-timeout``; a script, which imports nothing of ``ft_checkpoint``);
``servers.start("gcs")`` does.

Example:
    >>> _upload_id({"Location": "http://h/upload/storage/v1/b/b/o?uploadType=resumable&name=x&upload_id=42"})
    '42'
"""

from __future__ import annotations

import os
import sys
import urllib.parse
from http import HTTPStatus
from typing import Any

_MUST_NOT_EXIST: dict[str, tuple[str, str]] = {}
"""Resumable uploads started with ``ifGenerationMatch=0``: upload id -> (bucket, object)."""


def _exists(storage: Any, bucket: str, name: str) -> bool:
    from gcp_storage_emulator.exceptions import NotFound

    try:
        storage.get_file_obj(bucket, name)
    except NotFound:
        return False
    return True


def _condition_not_met(response: Any) -> None:
    message = "At least one of the pre-conditions you specified did not hold."
    response.status = HTTPStatus.PRECONDITION_FAILED
    response.json({"error": {"code": 412, "message": message,
                             "errors": [{"domain": "global", "reason": "conditionNotMet", "message": message}]}})


def _must_not_exist(request: Any) -> bool:
    return request.query.get("ifGenerationMatch") == ["0"]


def _upload_id(response: Any) -> str | None:
    query = urllib.parse.urlparse(response["Location"]).query
    return urllib.parse.parse_qs(query).get("upload_id", [None])[0]


def _object_name(request: Any) -> str:
    if "name" in request.query:
        return str(request.query["name"][0])
    data = request.data if isinstance(request.data, dict) else {}
    return str((data.get("meta") or data).get("name"))


def _honor_preconditions() -> None:
    from gcp_storage_emulator.handlers import objects

    needed = ("_media_upload", "_multipart_upload", "_create_resumable_upload", "_finalize_resumable_object")
    if not all(hasattr(objects, name) for name in needed):  # never a server that silently writes over
        raise RuntimeError("this gcp-storage-emulator has not the upload handlers whose preconditions the tests need "
                           f"({', '.join(needed)}). HINT: pip install 'gcp-storage-emulator>=2026.7'")

    def checked(upload: Any) -> Any:
        def upload_unless_it_exists(request: Any, response: Any, storage: Any) -> Any:
            if _must_not_exist(request) and _exists(storage, request.params["bucket_name"], _object_name(request)):
                return _condition_not_met(response)
            return upload(request, response, storage)
        return upload_unless_it_exists

    start_resumable, finalize = objects._create_resumable_upload, objects._finalize_resumable_object

    def start_resumable_remembering_its_precondition(request: Any, response: Any, storage: Any) -> Any:
        result = start_resumable(request, response, storage)
        if _must_not_exist(request) and "Location" in response._headers:
            _MUST_NOT_EXIST[str(_upload_id(response))] = (request.params["bucket_name"], _object_name(request))
        return result

    def finalize_unless_it_exists(response: Any, storage: Any, obj: Any, data: bytes, upload_id: str) -> Any:
        target = _MUST_NOT_EXIST.pop(upload_id, None)
        if target is not None and _exists(storage, *target):
            return _condition_not_met(response)
        return finalize(response, storage, obj, data, upload_id)

    objects._media_upload = checked(objects._media_upload)
    objects._multipart_upload = checked(objects._multipart_upload)
    objects._create_resumable_upload = start_resumable_remembering_its_precondition
    objects._finalize_resumable_object = finalize_unless_it_exists


def _write_atomically() -> None:
    import gcp_storage_emulator.storage as storage

    write = storage._FileStore.write_bytes

    def write_atomically(self: Any, rel: str, content: bytes) -> Any:
        if self._use_memory:
            return write(self, rel, content)
        write(self, rel + ".partial", content)
        os.replace(self._disk_path(rel + ".partial"), self._disk_path(rel))

    storage._FileStore.write_bytes = write_atomically


def main(argv: list[str]) -> int:
    """``--idle-timeout SECONDS`` then the emulator's own arguments."""
    import gcp_storage_emulator.server as server
    from gcp_storage_emulator.__main__ import main as emulator_main

    if argv[:1] == ["--idle-timeout"]:
        server.RequestHandler.timeout = float(argv[1])
        argv = argv[2:]
    _write_atomically()
    _honor_preconditions()
    return int(emulator_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
