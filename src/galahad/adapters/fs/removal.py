"""How entries leave a namespace folder: set aside (quarantine) or removed (eviction).

Either way the commit marker goes first, so no process offers the entry while its parts go.
Quarantined parts are moved into the namespace's quarantine folder as `<name>.<reason>` (its
newest `QUARANTINE_KEEP` files are kept, for a look at what went wrong); nothing is ever moved
into, or removed under, a folder this store does not trust (tree.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from galahad.adapters.fs.folder import part_names, unlink
from galahad.adapters.fs.index import CLOCK
from galahad.adapters.fs.layout import QUARANTINE_DIR, leaf_dir, marker_name, namespace_name
from galahad.adapters.fs.medium import unavailable, unlink_quietly
from galahad.adapters.fs.scan import QUARANTINE_KEEP, prune_quarantine
from galahad.adapters.fs.tree import Folder, FolderTree, RefusedFolder
from galahad.domain.error import StoreUnavailable

__all__ = ["quarantine_entry", "remove_entry"]


def quarantine_entry(tree: FolderTree, ns_rel: str, keyhex: str, reason: str, on_change: Callable[[], None]) -> bool:
    """Uncommit entry `keyhex` of the namespace folder `ns_rel` (its marker removed and the
    folder synced: no rank offers it again, even after a crash) and set its parts aside;
    whether there was anything to set aside. `on_change()` is called once something was, even
    when a later step fails. Nothing there, or a leaf folder this store does not trust, is
    False: a miss already."""
    leaf = tree.borrow(leaf_dir(ns_rel, keyhex), fresh=True)
    if leaf is None:
        return False
    changed = False
    try:
        if unlink(marker_name(keyhex), leaf.fd):
            changed = True
            os.fsync(leaf.fd)
        names = part_names(leaf.fd, leaf.path, keyhex)
        if names:
            changed = _set_aside(tree, ns_rel, leaf, names, reason) or changed
    except StoreUnavailable:
        raise
    except OSError as exc:
        raise unavailable("quarantine", f"{leaf.path}/{marker_name(keyhex)}", exc) from exc
    finally:
        tree.give_back(leaf)
        if changed:  # an entry already gone (evicted since its lookup) is not counted
            on_change()
    return changed


def remove_entry(tree: FolderTree, ns_hex: str, raw: bytes) -> None:
    """Remove an evicted entry's files, the marker first. An entry under a folder this store
    does not trust is only forgotten: nothing there is removed."""
    keyhex = raw.hex()
    leaf = tree.borrow(leaf_dir(namespace_name(ns_hex), keyhex), fresh=True)
    if leaf is None:
        return
    try:
        unlink_quietly(marker_name(keyhex), leaf.fd)
        for name in part_names(leaf.fd, leaf.path, keyhex):
            unlink_quietly(name, leaf.fd)
    finally:
        tree.give_back(leaf)


def _set_aside(tree: FolderTree, ns_rel: str, leaf: Folder, names: list[str], reason: str) -> bool:
    """Move the parts `names` of `leaf` into the namespace's quarantine folder as
    `<name>.<reason>` and prune it; whether any moved. When the quarantine folder is refused
    (a link planted there, another user's...: logged), they are removed instead: nothing is
    ever moved into a folder this store does not trust."""
    try:
        folder: Folder | None = tree.borrow(f"{ns_rel}/{QUARANTINE_DIR}", create=True, fresh=True)
    except RefusedFolder:
        folder = None
    moved = False
    try:
        for name in names:
            if folder is None:
                moved = unlink(name, leaf.fd) or moved
                continue
            aside = f"{name}.{reason}"
            try:
                os.replace(name, aside, src_dir_fd=leaf.fd, dst_dir_fd=folder.fd)
            except FileNotFoundError:
                continue  # evicted or quarantined by another process meanwhile
            moved = True
            tick = CLOCK.tick()  # quarantine time, for pruning the oldest
            os.utime(aside, ns=(tick, tick), dir_fd=folder.fd, follow_symlinks=False)
        if folder is not None:
            prune_quarantine(folder.fd, QUARANTINE_KEEP)
    finally:
        if folder is not None:
            tree.give_back(folder)
    return moved
