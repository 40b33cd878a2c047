"""`torch.distributed.checkpoint` reading without unrestricted pickle.

DCP reads `.metadata` with `pickle.load` and non-tensor values with `torch.load(weights_only=False)`.
dptrain verifies every file against the manifest first, and on top of that reads both through
restricted loaders: `.metadata` with an unpickler that only resolves DCP's own metadata classes,
and byte values with `torch.load(weights_only=True)`. A crafted checkpoint therefore cannot run
code even if its manifest was re-hashed to match.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

_ALLOWED = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP metadata classes, torch dtypes and a few inert helpers."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which dptrain does not load")


def load_metadata(data: bytes) -> Metadata:
    """Parse a DCP `.metadata` file's bytes with the restricted unpickler."""
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata is a {type(md).__name__}, not Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `load_metadata` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read())
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
