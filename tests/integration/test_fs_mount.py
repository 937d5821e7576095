"""Network and FUSE storage is recognised from the mount table, and named in one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from galahad.adapters.fs import FilesystemBlockStore, mount
from galahad.adapters.fs.mount import filesystem_of, is_remote, is_shared, parse_mountinfo, warn_if_remote
from galahad.domain.chain import ChainKey
from helpers.store_worker import NAMESPACE

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 27 0:40 / /mnt/models rw,relatime shared:7 - nfs4 fileserver:/export/models rw,vers=4.2
31 27 0:41 / /mnt/my\040cache rw,nosuid,nodev,relatime - fuse.sshfs me@host:/cache rw,user_id=0
32 27 0:42 / /data rw,relatime - ext4 /dev/nvme0n1 rw
33 32 0:43 / /data/shared rw,relatime master:3 - cifs //nas/shared rw
34 32 0:44 / /data/shared rw,relatime - ext4 /dev/nvme1n1 rw
35 27 0:45 / /scratch rw,relatime - lustre 10.0.0.1@tcp:/scratch rw
this line is not a mount
"""


def test_the_mount_table_parser_reads_types_sources_and_escaped_mount_points() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert [m.fstype for m in mounts] == ["proc", "ext4", "nfs4", "fuse.sshfs", "ext4", "cifs", "ext4", "lustre"]
    assert mounts[3].mount_point == "/mnt/my cache" and mounts[2].source == "fileserver:/export/models"


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/var/galahad", "ext4"),
        ("/mnt/models/galahad", "nfs4"),
        ("/mnt/modelsX/galahad", "ext4"),  # a prefix of the name is not a parent folder
        ("/mnt/my cache", "fuse.sshfs"),
        ("/data/galahad", "ext4"),
        ("/data/shared/galahad", "ext4"),  # mounted over the cifs share: the last one listed wins
        ("/scratch/x", "lustre"),
    ],
)
def test_the_longest_mount_point_holding_the_path_names_its_filesystem(path: str, fstype: str) -> None:
    mount = filesystem_of(path, parse_mountinfo(MOUNTINFO))
    assert mount is not None and mount.fstype == fstype


@pytest.mark.parametrize("fstype", ["nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "9p", "lustre", "fuse", "fuse.s3fs", "fuse.sshfs"])
def test_network_and_fuse_filesystems_are_remote(fstype: str) -> None:
    assert is_remote(fstype)


@pytest.mark.parametrize("fstype", ["ext4", "xfs", "btrfs", "tmpfs", "zfs", "overlay"])
def test_local_filesystems_are_not_remote(fstype: str) -> None:
    assert not is_remote(fstype)


def test_one_warning_names_the_store_and_its_network_filesystem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path = f"/mnt/models/{tmp_path.name}"  # warned once per path per process: a fresh one
    assert warn_if_remote(path, MOUNTINFO) == "nfs4"
    assert warn_if_remote(path, MOUNTINFO) == "nfs4"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"[galahad] store {path} is on nfs4, a shared network filesystem: servers that mount it with "
                        "the same GALAHAD_CACHE_DIR share its entries; loads are slower than from a local disk "
                        "(docs/store.md, A store shared by several servers)"]
    assert warn_if_remote("/var/galahad", MOUNTINFO) is None and len(caplog.records) == 1
    sshfs = f"/mnt/my cache/{tmp_path.name}"  # FUSE storage that only this machine mounts: named as slow
    assert warn_if_remote(sshfs, MOUNTINFO) == "fuse.sshfs"
    assert caplog.records[-1].getMessage() == (
        f"[galahad] store {sshfs} is on fuse.sshfs (network/FUSE storage): loads will be slow; use a local disk")


@pytest.mark.parametrize("fstype", ["nfs4", "cifs", "ceph", "glusterfs", "fuse.glusterfs", "lustre", "gpfs",
                                    "beegfs", "fuse.juicefs"])
def test_distributed_filesystems_are_shared(fstype: str) -> None:
    assert is_shared(fstype) and is_remote(fstype)


@pytest.mark.parametrize("fstype", ["ext4", "fuse", "fuse.sshfs", "fuse.s3fs", "9p", "davfs"])
def test_local_and_single_machine_fuse_filesystems_are_not_shared(fstype: str) -> None:
    assert not is_shared(fstype)


def test_opening_a_store_on_network_storage_warns_but_does_not_refuse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = tmp_path / "mountinfo"
    table.write_text(f"27 1 254:0 / / rw - ext4 /dev/vda rw\n40 27 0:50 / {tmp_path} rw - fuse.s3fs s3fs rw\n")
    monkeypatch.setattr(mount, "_MOUNTINFO", str(table))
    caplog.set_level(logging.WARNING)
    with FilesystemBlockStore(tmp_path / "store", NAMESPACE, max_bytes=1 << 30, rescan_s=None) as store:
        assert store.root.remote_fstype == "fuse.s3fs"
        assert store.put(ChainKey(bytes(32)), 0, b"still works")
    assert [r.getMessage() for r in caplog.records if "network/FUSE" in r.getMessage()] == [
        f"[galahad] store {tmp_path / 'store'} is on fuse.s3fs (network/FUSE storage): loads will be slow; use a local disk"
    ]


def test_a_store_on_local_disk_opens_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with FilesystemBlockStore(tmp_path, NAMESPACE, max_bytes=1 << 30, rescan_s=None) as store:
        local = store.root.remote_fstype is None
    if local:  # where the test folder itself is on network storage, the warning is right
        assert not [r for r in caplog.records if "network/FUSE" in r.getMessage()]
