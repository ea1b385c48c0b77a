"""Reading DCP checkpoints without unpickling arbitrary objects.

torch's :class:`~torch.distributed.checkpoint.FileSystemReader` reads the ``.metadata`` file with
``pickle.load``, which runs whatever code a crafted file names. :class:`SafeFileSystemReader`
reads it with an unpickler that resolves only the plain data classes DCP's metadata is made of
(tensor/chunk/bytes storage descriptions, ``torch.Size``, dtypes, layouts, paths) and raises
:class:`~torsh_distributed.runtime.errors.CheckpointError` for anything else. Tensor payloads are
raw storage bytes and non-tensor items go through ``torch.load(weights_only=True)`` in torch
itself, so together with the SHA-256 manifest nothing in a checkpoint directory can execute code.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torsh_distributed.runtime.errors import CheckpointError

__all__ = ["SafeFileSystemReader", "safe_load_metadata"]

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED: dict[str, frozenset[str]] = {
    "torch._utils": frozenset({"_get_layout"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        ):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not plain checkpoint data; "
            "refusing to unpickle it",
            operation="checkpoint.load",
            fix="only load checkpoints written by torch.distributed.checkpoint from a trusted source",
        )


def safe_load_metadata(data: bytes) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes with the allow-list above."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is a corrupt checkpoint
        raise CheckpointError(
            f"unreadable checkpoint metadata: {type(exc).__name__}: {exc}",
            operation="checkpoint.load",
        ) from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint metadata is a {type(metadata).__name__}, expected DCP Metadata",
            operation="checkpoint.load",
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A :class:`FileSystemReader` whose ``read_metadata`` never runs arbitrary pickled code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = safe_load_metadata(stream.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
