"""`galahad-format`: inspect block files and verify a store, offline (spec/format-v1.md).

    galahad-format dump [--json] [--verify] [--key-file PATH | --key-command CMD] FILE...
    galahad-format verify [--json] [--key-file PATH | --key-command CMD] STORE_DIR
    galahad-format stats [--json] STORE_DIR

Exit status: 0 all good; 1 a file was refused (dump) or a problem found (verify); 2 a usage
problem (a missing path or one that is not a regular file, not a store, a store folder that
cannot be read or that others can write to, an unusable key file or key command); 3 nothing
wrong found, but not all verified (`dump --verify`, `verify`): a sealed file without its key, or
an unencrypted file that a server holding the key given refuses; 141 when the output is cut
short (`| head`); 130 on Ctrl-C. A problem with a file is one line naming the file, never a
traceback. It only reads, on a running server's store too: a file is opened without waiting (a
FIFO is reported, never waited on), a link at a part's or marker's name is not followed (the
server follows none there), and a part gone since the scan was evicted or quarantined
meanwhile, which is no damage. Whatever sizes a header claims, a file is checked frame by frame
in memory bounded by one frame, and `dump` writes its frame table as it goes.

One module on purpose, past 500 lines: the three commands share one way of opening and judging a
file and one scan of the store, and each section below is one of them.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from galahad.adapters.fs import layout
from galahad.adapters.fs import marker as fs_marker
from galahad.adapters.fs import root as fs_root
from galahad.cli.output import print_any_name, stdout_closed
from galahad.format.codec import CipherLookup, Expect, read_header, verify_part
from galahad.domain.error import ConfigError, FormatError, GalahadError, StoreUnavailable, UnknownKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, Buffer, CipherId, Frame, frame_table
from galahad.ports.cipher import Cipher
from galahad.adapters.posix.regular_file import NotARegularFile, read_regular

__all__ = ["NOT_VERIFIED", "main"]

PROG = "galahad-format"
NOT_VERIFIED = 3  # the exit status when nothing wrong was found but not everything was verified
_CIPHER_NAMES = {CipherId.XXH3: "xxh3-128 checksum, no key", CipherId.AES_256_GCM: "AES-256-GCM"}


_LAYOUTS = {
    True: "aligned (v1.1: the payload in one piece at a multiple of 4096, then the tag table)",
    False: "flat (v1.0: each frame followed by its tag)",
}
_NOT_A_FILE = ("Missing", "NotAFile")  # Inspection.error values that make a usage problem of a path named to dump
_REMOVED = "removed meanwhile (evicted or quarantined by the server)"
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
_GONE = (errno.ENOENT, errno.ENOTDIR)  # a file or folder removed since it was listed
_CHECK = Xxh3FrameCheck()
_NOT_CHECKED = "not checked: "  # Inspection.frames: no key for a sealed file
_UNSEALED = "unsealed: "  # Inspection.frames: every checksum verified, but a server with a key refuses it
_UNSEALED_WHY = ("a checksum-only part (cipher 0, not encrypted): a server with a key refuses it, since anyone "
                 "who can write the store folder could have planted it")


class UsageProblem(Exception):
    """A problem with what the user asked for (exit status 2), said in one line."""


@attrs.frozen
class Inspection:
    """What one file turned out to be: a header, or a refusal; and the frames' verdict."""

    path: str
    header: BlockHeader | None = None
    error: str = ""  # the error class name when refused, or "Missing", "NotAFile", "OSError"
    reason: str = ""
    frames: str = ""  # "ok", "not checked: ...", "unsealed: ...", or "" when not asked
    removed: bool = False  # found by a store scan, gone when opened: evicted or quarantined meanwhile
    size: int = 0

    @property
    def bad(self) -> bool:
        return bool(self.error)

    @property
    def not_checked(self) -> bool:
        """Sealed under a key that was not given: its frames were not verified."""
        return self.frames.startswith(_NOT_CHECKED)

    @property
    def unsealed(self) -> bool:
        """Its checksums verified, but a server holding the key given refuses it (`_UNSEALED_WHY`)."""
        return self.frames.startswith(_UNSEALED)


# ---------------------------------------------------------------- keys


@attrs.define
class KeySource:
    """The ciphers a reader may use: the keyless check always, AES-GCM for the keys given (a key
    file's, or a key command's)."""

    keyring: Any = None  # an object with by_id(key_id) -> SecretKey | None
    make_cipher: Callable[[Any], Cipher] | None = None
    why_none: str = ("no key: give --key-file PATH or --key-command CMD, or set GALAHAD_KEY_FILE or "
                     "GALAHAD_KEY_COMMAND as the server has it")
    source: str = "the key file"
    _cache: dict[bytes, Cipher] = attrs.Factory(dict)

    def lookup(self, cipher_id: int, key_id: bytes) -> Cipher | None:
        if cipher_id == CipherId.XXH3:
            return _CHECK
        if cipher_id != CipherId.AES_256_GCM or self.keyring is None or self.make_cipher is None:
            return None
        if key_id not in self._cache:
            secret = self.keyring.by_id(key_id)
            if secret is None:
                return None
            self._cache[key_id] = self.make_cipher(secret)
        return self._cache[key_id]

    def missing(self, h: BlockHeader) -> str:
        if self.keyring is None:
            return f"{_NOT_CHECKED}{self.why_none}"
        return f"{_NOT_CHECKED}key id {h.key_id.hex()} is not in {self.source}"

    def server_refuses(self, h: BlockHeader) -> bool:
        """Whether a server holding these keys refuses a part with header `h` that verified: a
        server with a key accepts sealed parts only (`bootstrap._sealed_only`)."""
        return self.keyring is not None and h.cipher_id == CipherId.XXH3


def load_keys(key_file: str | None, key_command: str | None = None) -> KeySource:
    """The keys for sealed files: `--key-file` or `--key-command`, else the server's own settings
    (`GALAHAD_KEY_FILE` or `GALAHAD_KEY_COMMAND`); none when nothing names a key. A key file is
    never created here."""
    if key_file and key_command:
        raise UsageProblem("--key-file and --key-command are both given; give one")
    if not key_file and not key_command:  # read by the server's own rules: what it refuses, this refuses
        from galahad.config import key_source

        try:
            key_file, key_command = key_source(os.environ)
        except ConfigError as exc:
            raise UsageProblem(f"{exc}; or give --key-file or --key-command") from None
    if not key_file and not key_command:
        return KeySource()
    if key_file and not os.path.exists(key_file):  # a folder or a FIFO exists: the server's reader says what it is
        raise UsageProblem(f"{key_file}: key file not found")
    try:
        from galahad.adapters.crypto.aesgcm import AesGcmCipher
        from galahad.adapters.crypto.key import KeyCommandProvider, KeyFileProvider, command_label
    except ImportError as exc:
        return KeySource(why_none=f"no key: the crypto adapter cannot be imported ({exc})")
    try:
        if key_file:
            keyring = KeyFileProvider(key_file, create=False).load()
        else:
            keyring = KeyCommandProvider(key_command or "").load()
    except GalahadError as exc:
        raise UsageProblem(str(exc)) from None
    source = "the key file" if key_file else f"the keys printed by {command_label(key_command or '')}"
    return KeySource(keyring=keyring, make_cipher=AesGcmCipher, source=source)


# ---------------------------------------------------------------- inspecting one file


class _NotRegular(Exception):
    """What lies where a regular file was expected: its kind, e.g. "a FIFO"."""


def _open_regular(path: str, *, follow: bool) -> tuple[int, int]:
    """(descriptor, size) of the regular file at `path`, opened without waiting (a FIFO is
    reported, never waited on) and, unless `follow`, not through a symbolic link.
    `_NotRegular` for anything else; OSError when it cannot be opened."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise _NotRegular(_KINDS[stat.S_IFLNK]) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotRegular(_kind(st.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def examine(path: str, *, verify: bool, keys: KeySource, expect: Expect | None = None,
            scanned: bool = False) -> Inspection:
    """Read `path` (mapped, so only the header is read unless frames are verified) and judge it.

    A file found by scanning a store (`scanned`) is not followed if it is a symbolic link, and
    is `removed` (not bad) if it is gone: the server evicted or quarantined it meanwhile."""
    try:
        fd, size = _open_regular(path, follow=not scanned)
    except _NotRegular as exc:
        return Inspection(path, error="NotAFile", reason=f"not a regular file ({exc})")
    except FileNotFoundError:
        if scanned:
            return Inspection(path, removed=True, reason=_REMOVED)
        return Inspection(path, error="Missing", reason="no such file")
    except OSError as exc:
        return Inspection(path, error="OSError", reason=exc.strerror or str(exc))
    try:
        if size == 0:
            return _judge(path, b"", verify, keys, expect)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            return attrs.evolve(_judge(path, view, verify, keys, expect), size=size)
    except OSError as exc:
        return Inspection(path, error="OSError", reason=exc.strerror or str(exc), size=size)
    finally:
        os.close(fd)


def _judge(path: str, data: Buffer, verify: bool, keys: KeySource, expect: Expect | None) -> Inspection:
    try:
        header = read_header(data)
    except FormatError as exc:
        return Inspection(path, error=type(exc).__name__, reason=str(exc))
    if not verify and expect is None:
        return Inspection(path, header)
    try:
        verify_part(data, expect=expect or Expect(), ciphers=keys.lookup)  # a frame at a time
    except UnknownKey:
        return Inspection(path, header, frames=keys.missing(header))
    except FormatError as exc:
        return Inspection(path, header, error=type(exc).__name__, reason=str(exc))
    if keys.server_refuses(header):
        return Inspection(path, header, frames=_UNSEALED + _UNSEALED_WHY)
    return Inspection(path, header, frames="ok")


# ---------------------------------------------------------------- dump


def header_json(h: BlockHeader, *, frames: bool = True) -> dict[str, Any]:
    """The header as `dump --json` prints it; without `frames`, no frame table (`_dump_json`
    writes that one frame at a time)."""
    fields: dict[str, Any] = {
        "major": h.major, "minor": h.minor, "incompat_flags": h.incompat_flags, "compat_flags": h.compat_flags,
        "header_len": h.header_len, "namespace": h.namespace.hex(), "chain_key": h.chain_key.hex(),
        "token_start": h.token_start, "token_end": h.token_end, "rank": h.rank, "world": h.world,
        "block_size": h.block_size, "cipher_id": h.cipher_id, "key_id": h.key_id.hex(), "salt": h.salt.hex(),
        "frame_size": h.frame_size, "payload_len": h.payload_len, "frame_count": h.frame_count,
        "layout": "aligned" if h.aligned else "flat",
        "segments": [
            {"group": s.group, "kind": s.kind.name.lower(), "dtype": s.dtype.label, "layer": s.layer,
             "shape": list(s.shape), "nbytes": s.nbytes}
            for s in h.segments
        ],
    }
    if frames:
        fields["frames"] = [attrs.asdict(f) for f in frame_table(h)]
    return fields


def _dump_text(report: Inspection, out: Callable[[str], None]) -> None:
    h = report.header
    if h is None:
        return
    cipher = _CIPHER_NAMES.get(CipherId(h.cipher_id), "?")
    key = f", key id {h.key_id.hex()}" if h.cipher_id != CipherId.XXH3 else ""
    out(report.path)
    out(f"  format     v{h.major}.{h.minor}  incompat flags {h.incompat_flags:#x}  compat flags {h.compat_flags:#x}")
    out(f"  namespace  {h.namespace.hex()}")
    out(f"  chain key  {h.chain_key.hex()}")
    out(f"  tokens     [{h.token_start}, {h.token_end})  ({h.token_end - h.token_start} tokens, block size {h.block_size})")
    out(f"  rank       {h.rank} of {h.world}")
    out(f"  cipher     {h.cipher_id} ({cipher}{key})  salt {h.salt.hex()}")
    out(f"  layout     {_LAYOUTS[h.aligned]}")
    out(f"  sizes      header {h.header_len} B, payload {h.payload_len} B in {h.frame_count} frame(s) "
        f"of up to {h.frame_size} B")
    out(f"  segments   {len(h.segments)}")
    out(f"  {'#':>5}  {'group':>5}  {'kind':5s}  {'dtype':11s}  {'layer':>5}  {'shape':24s}  {'bytes':>10}  "
        f"{'payload offset':>14}")
    offset = 0
    for i, s in enumerate(h.segments):
        shape = "x".join(map(str, s.shape)) or "scalar"
        out(f"  {i:5d}  {s.group:5d}  {s.kind.name.lower():5s}  {s.dtype.label:11s}  {s.layer:5d}  "
            f"{shape:24s}  {s.nbytes:10d}  {offset:14d}")
        offset += s.nbytes
    out(f"  frames     {h.frame_count}")
    out(f"  {'#':>5}  {'payload offset':>14}  {'length':>10}  {'data offset':>14}  {'tag offset':>14}")
    for f in frame_table(h):
        out(f"  {f.index:5d}  {f.plain_offset:14d}  {f.plain_len:10d}  {f.data_offset:14d}  {f.tag_offset:14d}")
    if report.frames == "ok":
        out("  verify     OK: every frame verified")
    elif report.unsealed:
        out(f"  verify     UNSEALED: every frame's checksum verified, but {report.frames.removeprefix(_UNSEALED)}")
    elif report.frames:
        out(f"  verify     {report.frames}")
    if report.bad:
        out(f"  verify     FAILED: {report.reason} ({report.error})")


def cmd_dump(args: argparse.Namespace) -> int:
    keys = load_keys(args.key_file, args.key_command) if args.verify else KeySource()
    reports = []
    if args.json:
        sys.stdout.write("[")
    for n, path in enumerate(args.files):  # each file written out before the next is read
        report = examine(path, verify=args.verify, keys=keys)
        reports.append(attrs.evolve(report, header=None))  # what the exit status needs, no more
        if args.json:
            sys.stdout.write("," if n else "")
            _dump_json(report, sys.stdout.write)
        elif report.header is None:
            _complain(f"{report.path}: {_describe(report)}")
        else:
            _dump_text(report, print)
    if args.json:
        sys.stdout.write("\n]\n")
    if any(r.error in _NOT_A_FILE for r in reports):
        return 2  # a missing path, a folder or a FIFO: a usage problem, as the module docstring says
    if any(r.bad for r in reports):
        return 1
    return NOT_VERIFIED if any(r.not_checked or r.unsealed for r in reports) else 0


_FRAMES_AT = "\x00frames\x00"  # where a report's frame table goes in its JSON text
_FRAMES_PER_WRITE = 4096


def _dump_json(report: Inspection, write: Callable[[str], object]) -> None:
    """One report of `dump --json` (an element of its list), the frame table written a batch of
    frames at a time as it is walked: the memory it takes does not grow with the frame count."""
    text = json.dumps(_report_json(report), indent=2)
    head, mark, tail = text.partition(json.dumps(_FRAMES_AT))
    write("\n  " + head.replace("\n", "\n  "))
    if report.header is not None and mark:
        write("[")
        batch: list[str] = []
        for f in frame_table(report.header):
            batch.append(_frame_json(f))
            if len(batch) == _FRAMES_PER_WRITE or f.index == report.header.frame_count - 1:
                write(("," if f.index >= len(batch) else "") + ",".join(batch))
                batch.clear()
        write("\n      ]")
    write(tail.replace("\n", "\n  "))


def _frame_json(f: Frame) -> str:
    return (f'\n        {{"index": {f.index}, "plain_offset": {f.plain_offset}, "plain_len": {f.plain_len}, '
            f'"data_offset": {f.data_offset}, "tag_offset": {f.tag_offset}}}')


def _report_json(report: Inspection) -> dict[str, Any]:
    out: dict[str, Any] = {"file": report.path}
    if report.header is not None:
        out["header"] = {**header_json(report.header, frames=False), "frames": _FRAMES_AT}
    if report.bad:
        out["error"] = {"class": report.error, "message": report.reason}
    if report.frames:
        out["frames_verified"] = report.frames == "ok" or report.unsealed
        out["accepted"] = report.frames == "ok"  # what a server holding the keys given would load
        out["verify"] = report.frames
    return out


def _describe(report: Inspection) -> str:
    """A usage problem (a missing path, not a regular file) as is; a refused file with its class."""
    return report.reason if report.error in _NOT_A_FILE else f"{report.reason} ({report.error})"


# ---------------------------------------------------------------- the store (layout: adapters/fs/layout.py)


@attrs.define
class Entry:
    """One entry's files in a leaf folder: its part files and its commit marker, if any."""

    namespace: bytes
    key: bytes
    parts: dict[int, Path] = attrs.Factory(dict)
    marker: Path | None = None


Problem = tuple[str, str, str]  # (file, what is wrong, the class of problem: docs/format.md "What the errors mean")


@attrs.define
class StoreScan:
    """Every file of a store folder, sorted by role, and what kept some from being looked at.
    Reads names (and the manifest), changes nothing."""

    entries: dict[tuple[bytes, bytes], Entry] = attrs.Factory(dict)
    namespaces: dict[bytes, Path] = attrs.Factory(dict)
    quarantined: list[Path] = attrs.Factory(list)
    temp: list[Path] = attrs.Factory(list)
    misplaced: list[tuple[Path, str]] = attrs.Factory(list)
    problems: list[Problem] = attrs.Factory(list)  # an unusable manifest, folders that cannot be read

    def parts(self) -> list[tuple[Path, Entry, int]]:
        return [(path, e, part) for e in self.entries.values() for part, path in sorted(e.parts.items())]


def scan_store(root: Path) -> StoreScan:
    """Sort the files of the store at `root`; UsageProblem for a root the server would refuse
    for its permissions, one that cannot be read, or one that is no store."""
    names = _list_root(root)
    scan = StoreScan()
    for name in names:
        ns_hex = layout.parse_namespace_dir(name)
        if ns_hex is not None and (root / name).is_dir():
            scan.namespaces[bytes.fromhex(ns_hex)] = root / name
    _check_root(root, scan)
    for namespace, folder in scan.namespaces.items():
        for path in sorted(_files(folder, scan.problems)):
            _sort_file(scan, folder, namespace, path)
    return scan


def _list_root(root: Path) -> list[str]:
    if not root.exists():
        raise UsageProblem(f"{root}: no such folder")
    if not root.is_dir():
        raise UsageProblem(f"{root}: not a folder (give the store folder, GALAHAD_CACHE_DIR)")
    try:
        return sorted(os.listdir(root))
    except OSError as exc:
        raise UsageProblem(f"{root}: cannot read the store folder ({exc.strerror}); run {PROG} as its owner "
                           f"(uid {root.stat().st_uid}), or fix its mode: chmod 700 {root}") from None


def _check_root(root: Path, scan: StoreScan) -> None:
    """Refuse what the server refuses, in its words: a root others can write to (a usage problem,
    as is a manifest this user cannot read); a manifest it cannot use is a problem of the store.
    A root with namespace folders and no manifest is read as it is."""
    path = os.path.abspath(root)
    try:
        fs_root._check_folder(path, owner=False)  # the server's own check: tools accept another owner
    except StoreUnavailable as exc:
        raise UsageProblem(str(exc.strerror)) from None
    manifest = root / layout.MANIFEST_NAME
    try:
        mode: int | None = os.stat(manifest).st_mode  # a link followed, as the server does
    except OSError:
        mode = None  # absent, or StoreRoot.open says why not
    if mode is not None and not stat.S_ISREG(mode):  # the server's open would wait on a FIFO for ever
        scan.problems.append((str(manifest), f"not a regular file ({_kind(mode)})", "NotAFile"))
        return
    try:
        fs_root.StoreRoot.open(path)
    except StoreUnavailable as exc:
        if exc.errno == errno.ENOENT and scan.namespaces:
            return
        if exc.errno == errno.ENOENT:
            raise UsageProblem(f"{root}: not a Galahad store (no {layout.MANIFEST_NAME} and no ns-<digest> folders)")
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UsageProblem(str(exc.strerror)) from None
        scan.problems.append((str(manifest), str(exc.strerror), "StoreUnavailable"))


def _files(folder: Path, problems: list[Problem]) -> Iterator[Path]:
    """The files under `folder`; each sub-folder that cannot be read is added to `problems`."""
    def unreadable(exc: OSError) -> None:
        if exc.errno not in _GONE:  # a folder removed meanwhile is no problem
            problems.append((str(exc.filename), f"cannot read the folder ({exc.strerror}): the files in it were "
                             "not checked; run as the store's owner", "OSError"))

    for base, _dirs, names in os.walk(folder, onerror=unreadable):
        for name in names:
            yield Path(base) / name


def _sort_file(scan: StoreScan, folder: Path, namespace: bytes, path: Path) -> None:
    relative = path.relative_to(folder).parts
    parsed = layout.parse_name(path.name)
    if relative[0] == layout.QUARANTINE_DIR:
        scan.quarantined.append(path)
    elif path.name.startswith(layout.TEMP_PREFIX):
        scan.temp.append(path)
    elif relative == (layout.NAMESPACE_FILE,):
        pass
    elif parsed is None:
        scan.misplaced.append((path, "not a file of a Galahad store"))
    elif relative[:-1] != (parsed[0][0:2], parsed[0][2:4]):
        scan.misplaced.append((path, f"outside its folder {parsed[0][0:2]}/{parsed[0][2:4]}/"))
    else:
        key = bytes.fromhex(parsed[0])
        entry = scan.entries.setdefault((namespace, key), Entry(namespace, key))
        if parsed[1] is None:
            entry.marker = path
        else:
            entry.parts[parsed[1]] = path


def commit_problem(entry: Entry) -> tuple[str, str] | None:
    """Why a committed entry is not whole, with the class of problem: its marker is unreadable or
    not one Galahad writes, or lists parts absent or of another size; None if whole or gone."""
    if entry.marker is None:
        return None
    try:
        sizes = fs_marker.decode(read_regular(str(entry.marker), fs_marker.MAX_BYTES, follow_links=False))
    except NotARegularFile as exc:  # the store's own reader: no link followed, no FIFO waited on
        return f"commit marker is not a regular file ({exc.kind})", "NotAFile"
    except OSError as exc:
        return None if exc.errno in _GONE else (f"commit marker unreadable ({exc.strerror})", "OSError")
    if sizes is None:
        return "commit marker is not one Galahad writes", "IncompleteEntry"
    for part, size in sorted(sizes.items()):
        path = entry.parts.get(part)
        if path is None:
            return f"committed, but part {part} is missing", "IncompleteEntry"
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile (evicted or quarantined), or unreadable: said by its own line
        if stat.S_ISREG(st.st_mode) and st.st_size != size:
            return f"committed, but part {part} is {st.st_size} bytes, the marker says {size}", "IncompleteEntry"
    return None




def cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    root = Path(args.store)
    scan = scan_store(root)
    keys = load_keys(args.key_file, args.key_command)
    reports = []
    for path, entry, part in tqdm(scan.parts(), desc="verifying", unit="part", file=sys.stderr, disable=None,
                                  leave=False):
        expect = Expect(namespace=entry.namespace, chain_key=entry.key, rank=part)
        reports.append(examine(str(path), verify=True, keys=keys, expect=expect, scanned=True))
    bad = scan.problems + [(r.path, r.reason, r.error) for r in reports if r.bad]
    bad += [(str(p), why, "Misplaced") for p, why in scan.misplaced]
    bad += [(str(e.marker), *found) for e in scan.entries.values() if (found := commit_problem(e))]
    unchecked = [r for r in reports if r.not_checked]
    unsealed = [r for r in reports if r.unsealed]
    removed = [r for r in reports if r.removed]
    good = len(reports) - sum(r.bad for r in reports) - len(unchecked) - len(unsealed) - len(removed)
    if args.json:
        print(json.dumps({
            "store": str(root), "parts_checked": len(reports), "good": good,
            "bad": [{"file": f, "reason": f"{why} ({kind})", "class": kind} for f, why, kind in bad],
            "not_checked": [{"file": r.path, "reason": r.frames} for r in unchecked],
            "unsealed": [{"file": r.path, "reason": r.frames.removeprefix(_UNSEALED)} for r in unsealed],
            "removed": [r.path for r in removed],
            "quarantined": [str(p) for p in scan.quarantined], "temp": [str(p) for p in scan.temp],
        }, indent=2))
    else:
        for f, why, kind in bad:
            print(f"BAD          {f}: {why} ({kind})")
        for r in unchecked:
            print(f"NOT CHECKED  {r.path}: {r.frames.removeprefix(_NOT_CHECKED)}")
        for r in unsealed:
            print(f"UNSEALED     {r.path}: {r.frames.removeprefix(_UNSEALED)}")
        for r in removed:
            print(f"REMOVED      {r.path}: {r.reason}")
        for p in scan.quarantined:
            print(f"QUARANTINED  {p}")
        print(f"{len(reports)} part file(s) checked: {good} good, {sum(r.bad for r in reports)} bad, "
              f"{len(unchecked)} not checked, {len(unsealed)} unsealed, {len(removed)} removed meanwhile; "
              f"{len(bad)} problem(s) in all; {len(scan.quarantined)} quarantined, {len(scan.temp)} temp file(s)")
    if bad:
        return 1
    return NOT_VERIFIED if unchecked or unsealed else 0


def cmd_stats(args: argparse.Namespace) -> int:
    root = Path(args.store)
    scan = scan_store(root)
    spaces = {ns: _namespace_stats(scan, ns, folder) for ns, folder in scan.namespaces.items()}
    totals = {k: sum(s[k] for s in spaces.values())
              for k in ("committed_entries", "entries_with_parts", "parts", "part_bytes", "unreadable_headers")}
    totals.update(quarantined_files=len(scan.quarantined), temp_files=len(scan.temp), namespaces=len(spaces),
                  unreadable_folders=sum(kind == "OSError" for _, _, kind in scan.problems))
    if args.json:
        print(json.dumps({"store": str(root), "totals": totals,
                          "namespaces": {ns.hex(): s for ns, s in spaces.items()},
                          "problems": [{"file": f, "reason": f"{why} ({kind})", "class": kind}
                                       for f, why, kind in scan.problems]}, indent=2))
        return 0
    print(f"store        {root}")
    print(f"namespaces   {totals['namespaces']}")
    print(f"entries      {totals['committed_entries']} committed, {totals['entries_with_parts']} with part files")
    print(f"parts        {totals['parts']} ({_size(totals['part_bytes'])}); "
          f"{totals['unreadable_headers']} with a header that cannot be read")
    print(f"quarantined  {totals['quarantined_files']} file(s); temp files {totals['temp_files']}")
    for f, why, kind in scan.problems:
        print(f"PROBLEM      {f}: {why} ({kind})")
    for ns, s in spaces.items():
        print(f"ns-{ns.hex()[:16]}…  model {s['model'] or '?'}: {s['committed_entries']} committed, "
              f"{s['parts']} parts, {_size(s['part_bytes'])}, ranks {s['ranks'] or '-'}, "
              f"world {s['world_sizes'] or '-'}, tokens {s['tokens']}")
    return 0


def _namespace_stats(scan: StoreScan, namespace: bytes, folder: Path) -> dict[str, Any]:
    entries = [e for e in scan.entries.values() if e.namespace == namespace]
    found = [(examine(str(path), verify=False, keys=KeySource(), scanned=True), part)
             for e in entries for part, path in e.parts.items()]
    parts = [(report, part) for report, part in found if not report.removed]  # gone meanwhile: not counted
    headers = [(report.header, part) for report, part in parts if report.header is not None]
    return {
        "model": _model_name(folder),
        "committed_entries": sum(e.marker is not None for e in entries),
        "entries_with_parts": sum(bool(e.parts) for e in entries),
        "parts": len(parts), "part_bytes": sum(report.size for report, _ in parts),
        "ranks": sorted({part for _, part in parts}), "world_sizes": sorted({h.world for h, _ in headers}),
        "tokens": sum(h.token_end - h.token_start for h, part in headers if part == 0),  # each entry's once
        "unreadable_headers": len(parts) - len(headers),
        "quarantined_files": sum(p.is_relative_to(folder) for p in scan.quarantined),
    }


def _model_name(folder: Path) -> str:
    try:
        data = json.loads(read_regular(str(folder / layout.NAMESPACE_FILE), 1 << 20, follow_links=False))
    except (OSError, ValueError):  # NotARegularFile is an OSError
        return ""
    found = data.get("model", data.get("namespace", {}).get("model", "")) if isinstance(data, dict) else ""
    return found if isinstance(found, str) else ""


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


# ---------------------------------------------------------------- entry point


def _complain(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Inspect Galahad block files and verify a store.")
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="print the header, segment table and frame table of block files")
    dump.add_argument("files", nargs="+", metavar="FILE")
    dump.add_argument("--verify", action="store_true", help="also check every frame (sealed files need the key)")
    verify = sub.add_parser("verify", help="check every part file of a store; exit 1 if any is bad, "
                            f"{NOT_VERIFIED} if any could not be verified or a server with the key refuses it")
    verify.add_argument("store", metavar="STORE_DIR")
    stats = sub.add_parser("stats", help="summarise a store: entries, bytes, namespaces, ranks")
    stats.add_argument("store", metavar="STORE_DIR")
    for each in (dump, verify, stats):
        each.add_argument("--json", action="store_true", help="print JSON for machines")
    for each in (dump, verify):
        each.add_argument("--key-file", metavar="PATH", help="key file for sealed files (default: $GALAHAD_KEY_FILE)")
        each.add_argument("--key-command", metavar="CMD",
                          help="command printing the keys for sealed files, as GALAHAD_KEY_COMMAND (its default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print_any_name()
    commands = {"dump": cmd_dump, "verify": cmd_verify, "stats": cmd_stats}
    try:
        code = commands[args.command](args)
        sys.stdout.flush()  # a reader gone early is found here, not in Python's flush at exit
        return code
    except UsageProblem as exc:
        _complain(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return stdout_closed()


if __name__ == "__main__":
    sys.exit(main())
