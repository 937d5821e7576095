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

Opening and judging a file is `galahad.cli.examine`, the scan of a store `galahad.cli.store_scan`;
this module holds the three commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from galahad.cli.examine import (NOT_CHECKED, PROG, UNSEALED, Inspection, KeySource, UsageProblem, examine,
                                 load_keys)
from galahad.cli.output import print_any_name, stdout_closed
from galahad.cli.store_scan import StoreScan, commit_problem, scan_store
from galahad.adapters.fs import layout
from galahad.adapters.posix.regular_file import read_regular
from galahad.format.codec import Expect
from galahad.format.v1 import BlockHeader, CipherId, Frame, frame_table

__all__ = ["NOT_VERIFIED", "main"]

_CIPHER_NAMES = {CipherId.XXH3: "xxh3-128 checksum, no key", CipherId.AES_256_GCM: "AES-256-GCM"}
_LAYOUTS = {
    True: "aligned (v1.1: the payload in one piece at a multiple of 4096, then the tag table)",
    False: "flat (v1.0: each frame followed by its tag)",
}
NOT_VERIFIED = 3  # the exit status when nothing wrong was found but not everything was verified
_NOT_A_FILE = ("Missing", "NotAFile")  # Inspection.error values that make a usage problem of a path named to dump


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
        out(f"  verify     UNSEALED: every frame's checksum verified, but {report.frames.removeprefix(UNSEALED)}")
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
            "unsealed": [{"file": r.path, "reason": r.frames.removeprefix(UNSEALED)} for r in unsealed],
            "removed": [r.path for r in removed],
            "quarantined": [str(p) for p in scan.quarantined], "temp": [str(p) for p in scan.temp],
        }, indent=2))
    else:
        for f, why, kind in bad:
            print(f"BAD          {f}: {why} ({kind})")
        for r in unchecked:
            print(f"NOT CHECKED  {r.path}: {r.frames.removeprefix(NOT_CHECKED)}")
        for r in unsealed:
            print(f"UNSEALED     {r.path}: {r.frames.removeprefix(UNSEALED)}")
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
