"""`galahad-format`: inspect block files and verify a store, offline (spec/format-v1.md).

    galahad-format dump [--json] [--verify] [--key-file PATH] FILE...
    galahad-format verify [--json] [--key-file PATH] STORE_DIR
    galahad-format stats [--json] STORE_DIR

Exit status: 0 all good; 1 a file was refused (dump) or a part is bad (verify); 2 a usage
problem (a missing path, not a store, an unusable key file). A problem with a file is one line
naming the file, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from galahad.adapters.fs import layout
from galahad.adapters.fs import marker as fs_marker
from galahad.codec import CipherLookup, Expect, open_part, read_header
from galahad.domain.error import FormatError, GalahadError, UnknownKey
from galahad.format.checksum import Xxh3FrameCheck
from galahad.format.v1 import BlockHeader, Buffer, CipherId, frame_table
from galahad.ports.cipher import Cipher

__all__ = ["main"]

PROG = "galahad-format"
_CIPHER_NAMES = {CipherId.XXH3: "xxh3-128 checksum, no key", CipherId.AES_256_GCM: "AES-256-GCM"}


_LAYOUTS = {
    True: "aligned (v1.1: the payload in one piece at a multiple of 4096, then the tag table)",
    False: "flat (v1.0: each frame followed by its tag)",
}
_FILE_PROBLEMS = ("Missing", "NotAFile", "OSError")  # Inspection.error values that are not format errors
_CHECK = Xxh3FrameCheck()


class UsageProblem(Exception):
    """A problem with what the user asked for (exit status 2), said in one line."""


@attrs.frozen
class Inspection:
    """What one file turned out to be: a header, or a refusal; and the frames' verdict."""

    path: str
    header: BlockHeader | None = None
    error: str = ""  # the error class name when refused, or one of _FILE_PROBLEMS
    reason: str = ""
    frames: str = ""  # "ok", "not checked: ...", or "" when not asked

    @property
    def bad(self) -> bool:
        return bool(self.error)


# ---------------------------------------------------------------- keys


@attrs.define
class KeySource:
    """The ciphers a reader may use: the keyless check always, AES-GCM for keys of the key file."""

    keyring: Any = None  # an object with by_id(key_id) -> SecretKey | None
    make_cipher: Callable[[Any], Cipher] | None = None
    why_none: str = "no key: give --key-file PATH or set GALAHAD_KEY_FILE"
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
            return f"not checked: {self.why_none}"
        return f"not checked: key id {h.key_id.hex()} is not in the key file"


def load_keys(key_file: str | None) -> KeySource:
    path = key_file or os.environ.get("GALAHAD_KEY_FILE") or None
    if path is None:
        return KeySource()
    if not os.path.isfile(path):
        raise UsageProblem(f"{path}: key file not found")
    try:
        from galahad.adapters.crypto.aesgcm import AesGcmCipher
        from galahad.adapters.crypto.key import load_keyring
    except ImportError as exc:
        return KeySource(why_none=f"no key: the crypto adapter cannot be imported ({exc})")
    try:
        keyring = load_keyring(key_file=path)
    except GalahadError as exc:
        raise UsageProblem(str(exc)) from None
    return KeySource(keyring=keyring, make_cipher=AesGcmCipher)


# ---------------------------------------------------------------- inspecting one file


def examine(path: str, *, verify: bool, keys: KeySource, expect: Expect | None = None) -> Inspection:
    """Read `path` (mapped, so only the header is read unless frames are verified) and judge it."""
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                return _judge(path, b"", verify, keys, expect)
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                return _judge(path, view, verify, keys, expect)
    except IsADirectoryError:
        return Inspection(path, error="NotAFile", reason="is a directory")
    except FileNotFoundError:
        return Inspection(path, error="Missing", reason="no such file")
    except OSError as exc:
        return Inspection(path, error="OSError", reason=exc.strerror or str(exc))


def _judge(path: str, data: Buffer, verify: bool, keys: KeySource, expect: Expect | None) -> Inspection:
    try:
        header = read_header(data)
    except FormatError as exc:
        return Inspection(path, error=type(exc).__name__, reason=str(exc))
    if not verify and expect is None:
        return Inspection(path, header)
    try:
        open_part(data, expect=expect or Expect(), ciphers=keys.lookup)
    except UnknownKey:
        return Inspection(path, header, frames=keys.missing(header))
    except FormatError as exc:
        return Inspection(path, header, error=type(exc).__name__, reason=str(exc))
    return Inspection(path, header, frames="ok")


# ---------------------------------------------------------------- dump


def header_json(h: BlockHeader) -> dict[str, Any]:
    return {
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
        "frames": [attrs.asdict(f) for f in frame_table(h)],
    }


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
    if report.frames:
        out(f"  verify     {'OK: every frame verified' if report.frames == 'ok' else report.frames}")
    if report.bad:
        out(f"  verify     FAILED: {report.reason} ({report.error})")


def cmd_dump(args: argparse.Namespace) -> int:
    keys = load_keys(args.key_file) if args.verify else KeySource()
    reports = [examine(path, verify=args.verify, keys=keys) for path in args.files]
    if args.json:
        print(json.dumps([_report_json(r) for r in reports], indent=2))
    else:
        for report in reports:
            if report.header is None:
                _complain(f"{report.path}: {_describe(report)}")
            else:
                _dump_text(report, print)
    if any(r.error in _NOT_A_FILE for r in reports):
        return 2  # a missing path or a folder: a usage problem, as the module docstring says
    return 1 if any(r.bad for r in reports) else 0


_NOT_A_FILE = ("Missing", "NotAFile")


def _report_json(report: Inspection) -> dict[str, Any]:
    out: dict[str, Any] = {"file": report.path}
    if report.header is not None:
        out["header"] = header_json(report.header)
    if report.bad:
        out["error"] = {"class": report.error, "message": report.reason}
    if report.frames:
        out["frames_verified"] = report.frames == "ok"
        out["verify"] = report.frames
    return out


def _describe(report: Inspection) -> str:
    if report.error == "FormatError" and report.reason.startswith("not a Galahad block"):
        return report.reason
    if report.error in _FILE_PROBLEMS:
        return report.reason
    return f"{report.reason} ({report.error})"


# ---------------------------------------------------------------- the store (layout: adapters/fs/layout.py)


@attrs.define
class Entry:
    """One entry's files in a leaf folder: its part files and its commit marker, if any."""

    namespace: bytes
    key: bytes
    parts: dict[int, Path] = attrs.Factory(dict)
    marker: Path | None = None


@attrs.define
class StoreScan:
    """Every file of a store folder, sorted by role. Reads names only, changes nothing."""

    entries: dict[tuple[bytes, bytes], Entry] = attrs.Factory(dict)
    namespaces: dict[bytes, Path] = attrs.Factory(dict)
    quarantined: list[Path] = attrs.Factory(list)
    temp: list[Path] = attrs.Factory(list)
    misplaced: list[tuple[Path, str]] = attrs.Factory(list)

    def parts(self) -> list[tuple[Path, Entry, int]]:
        return [(path, e, part) for e in self.entries.values() for part, path in sorted(e.parts.items())]


def scan_store(root: Path) -> StoreScan:
    if not root.exists():
        raise UsageProblem(f"{root}: no such folder")
    if not root.is_dir():
        raise UsageProblem(f"{root}: not a folder (give the store folder, GALAHAD_CACHE_DIR)")
    scan = StoreScan()
    for folder in sorted(root.iterdir()):
        ns_hex = layout.parse_namespace_dir(folder.name) if folder.is_dir() else None
        if ns_hex is not None:
            scan.namespaces[bytes.fromhex(ns_hex)] = folder
            for path in sorted(_files(folder)):
                _sort_file(scan, folder, bytes.fromhex(ns_hex), path)
    if not (root / layout.MANIFEST_NAME).is_file() and not scan.namespaces:
        raise UsageProblem(f"{root}: not a Galahad store (no {layout.MANIFEST_NAME} and no ns-<digest> folders)")
    return scan


def _files(folder: Path) -> Iterator[Path]:
    for base, _dirs, names in os.walk(folder):
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


def commit_problem(entry: Entry) -> str:
    """Why a committed entry is not whole (its marker lists parts absent or of another size), or ""."""
    if entry.marker is None:
        return ""
    try:
        sizes = fs_marker.decode(entry.marker.read_bytes())
    except OSError as exc:
        return f"commit marker unreadable ({exc.strerror})"
    if sizes is None:
        return "commit marker is not one Galahad writes"
    for part, size in sorted(sizes.items()):
        path = entry.parts.get(part)
        if path is None:
            return f"committed, but part {part} is missing"
        if path.stat().st_size != size:
            return f"committed, but part {part} is {path.stat().st_size} bytes, the marker says {size}"
    return ""


def cmd_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    root = Path(args.store)
    scan = scan_store(root)
    keys = load_keys(args.key_file)
    reports = []
    for path, entry, part in tqdm(scan.parts(), desc="verifying", unit="part", file=sys.stderr, disable=None,
                                  leave=False):
        expect = Expect(namespace=entry.namespace, chain_key=entry.key, rank=part)
        reports.append(examine(str(path), verify=True, keys=keys, expect=expect))
    bad = [(r.path, f"{r.reason} ({r.error})") for r in reports if r.bad]
    bad += [(str(p), why) for p, why in scan.misplaced]
    bad += [(str(e.marker), why) for e in scan.entries.values() if (why := commit_problem(e))]
    unchecked = [r for r in reports if r.frames.startswith("not checked")]
    good = len(reports) - sum(r.bad for r in reports) - len(unchecked)
    if args.json:
        print(json.dumps({
            "store": str(root), "parts_checked": len(reports), "good": good,
            "bad": [{"file": f, "reason": why} for f, why in bad],
            "not_checked": [{"file": r.path, "reason": r.frames} for r in unchecked],
            "quarantined": [str(p) for p in scan.quarantined], "temp": [str(p) for p in scan.temp],
        }, indent=2))
    else:
        for f, why in bad:
            print(f"BAD          {f}: {why}")
        for r in unchecked:
            print(f"NOT CHECKED  {r.path}: {r.frames.removeprefix('not checked: ')}")
        for p in scan.quarantined:
            print(f"QUARANTINED  {p}")
        print(f"{len(reports)} part file(s) checked: {good} good, {sum(r.bad for r in reports)} bad, "
              f"{len(unchecked)} not checked; {len(bad)} problem(s) in all; {len(scan.quarantined)} quarantined, "
              f"{len(scan.temp)} temp file(s)")
    return 1 if bad else 0


def cmd_stats(args: argparse.Namespace) -> int:
    root = Path(args.store)
    scan = scan_store(root)
    spaces = {ns: _namespace_stats(scan, ns, folder) for ns, folder in scan.namespaces.items()}
    totals = {k: sum(s[k] for s in spaces.values())
              for k in ("committed_entries", "entries_with_parts", "parts", "part_bytes", "unreadable_headers")}
    totals.update(quarantined_files=len(scan.quarantined), temp_files=len(scan.temp), namespaces=len(spaces))
    if args.json:
        print(json.dumps({"store": str(root), "totals": totals,
                          "namespaces": {ns.hex(): s for ns, s in spaces.items()}}, indent=2))
        return 0
    print(f"store        {root}")
    print(f"namespaces   {totals['namespaces']}")
    print(f"entries      {totals['committed_entries']} committed, {totals['entries_with_parts']} with part files")
    print(f"parts        {totals['parts']} ({_size(totals['part_bytes'])})")
    print(f"quarantined  {totals['quarantined_files']} file(s); temp files {totals['temp_files']}")
    for ns, s in spaces.items():
        print(f"ns-{ns.hex()[:16]}…  model {s['model'] or '?'}: {s['committed_entries']} committed, "
              f"{s['parts']} parts, {_size(s['part_bytes'])}, ranks {s['ranks'] or '-'}, "
              f"world {s['world_sizes'] or '-'}, tokens {s['tokens']}")
    return 0


def _namespace_stats(scan: StoreScan, namespace: bytes, folder: Path) -> dict[str, Any]:
    entries = [e for e in scan.entries.values() if e.namespace == namespace]
    parts = [(path, part) for e in entries for part, path in e.parts.items()]
    worlds: set[int] = set()
    tokens = unreadable = 0
    for path, part in parts:
        header = examine(str(path), verify=False, keys=KeySource()).header
        if header is None:
            unreadable += 1
            continue
        worlds.add(header.world)
        if part == 0:  # every entry has a part 0: count its tokens once
            tokens += header.token_end - header.token_start
    return {
        "model": _model_name(folder),
        "committed_entries": sum(e.marker is not None for e in entries),
        "entries_with_parts": sum(bool(e.parts) for e in entries),
        "parts": len(parts), "part_bytes": sum(p.stat().st_size for p, _ in parts),
        "ranks": sorted({part for _, part in parts}), "world_sizes": sorted(worlds),
        "tokens": tokens, "unreadable_headers": unreadable,
        "quarantined_files": sum(p.is_relative_to(folder) for p in scan.quarantined),
    }


def _model_name(folder: Path) -> str:
    try:
        data = json.loads((folder / "namespace.json").read_text())
    except (OSError, ValueError):
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
    verify = sub.add_parser("verify", help="check every part file of a store; exit 1 if any is bad")
    verify.add_argument("store", metavar="STORE_DIR")
    stats = sub.add_parser("stats", help="summarise a store: entries, bytes, namespaces, ranks")
    stats.add_argument("store", metavar="STORE_DIR")
    for each in (dump, verify, stats):
        each.add_argument("--json", action="store_true", help="print JSON for machines")
    for each in (dump, verify):
        each.add_argument("--key-file", metavar="PATH", help="key file for sealed files (default: $GALAHAD_KEY_FILE)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"dump": cmd_dump, "verify": cmd_verify, "stats": cmd_stats}
    try:
        return commands[args.command](args)
    except UsageProblem as exc:
        _complain(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    sys.exit(main())
