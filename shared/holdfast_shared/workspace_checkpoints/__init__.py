"""Workspace checkpoints kept off the tool-runner's disk.

A task's workspace is archived content-addressed (the tool-runner's
``workspace_tree.py``, the only writer and reader of a tree): each file's
content is one zstd-compressed blob keyed by its SHA-256, stored once per
tenant; an archive is a manifest (``manifest.py``) of paths to blobs, modes,
sizes, mtimes and symlink targets. Archives live where every tool-runner
reaches them (``stores.py``: PostgreSQL or a directory). Other services ask a
tool-runner for a checkpoint or a restore through ``requests.py``.
"""

from holdfast_shared.workspace_checkpoints.manifest import Entry, Manifest, ManifestError
from holdfast_shared.workspace_checkpoints.requests import (
    WorkspaceRequestError,
    WorkspaceRequestTimeout,
    checkpoint_workspace,
    restore_workspace,
)
from holdfast_shared.workspace_checkpoints.stores import (
    ArchiveStore,
    DirectoryStore,
    PostgresStore,
    store_from_settings,
)

__all__ = [
    "ArchiveStore",
    "DirectoryStore",
    "Entry",
    "Manifest",
    "ManifestError",
    "PostgresStore",
    "WorkspaceRequestError",
    "WorkspaceRequestTimeout",
    "checkpoint_workspace",
    "restore_workspace",
    "store_from_settings",
]
