"""The store's folder layout (fixed: tools read it; docs/store.md describes it).

    ROOT/galahad-store.json                                   store manifest
    ROOT/ns-<namespace digest hex>/namespace.json             the namespace, self-describing
    ROOT/ns-<hex>/<k[0:2]>/<k[2:4]>/<keyhex>.p<part>.blk      one rank's part of an entry
    ROOT/ns-<hex>/<k[0:2]>/<k[2:4]>/<keyhex>.ok               commit marker
    ROOT/ns-<hex>/<k[0:2]>/<k[2:4]>/.tmp-<random>             a write in progress
    ROOT/ns-<hex>/quarantine/<keyhex>.p<part>.blk.<reason>    a part set aside

Only hex digits from keys and digests, decimal part numbers and fixed words reach a path.
"""

from __future__ import annotations

import os
import re

from galahad.adapters.posix.atomic import TEMP_PREFIX

__all__ = [
    "MANIFEST_NAME",
    "NAMESPACE_FILE",
    "QUARANTINE_DIR",
    "TEMP_PREFIX",
    "leaf_dir",
    "marker_name",
    "namespace_dir",
    "namespace_name",
    "parse_name",
    "parse_namespace_dir",
    "part_name",
    "part_prefix",
]

MANIFEST_NAME = "galahad-store.json"
NAMESPACE_FILE = "namespace.json"
QUARANTINE_DIR = "quarantine"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NS_DIR = re.compile(r"ns-([0-9a-f]{64})")
_FILE = re.compile(r"([0-9a-f]{64})(?:\.p(0|[1-9][0-9]{0,4})\.blk|(\.ok))")


def namespace_name(ns_hex: str) -> str:
    """The name of a namespace's folder in the root: `ns-<digest hex>`."""
    if not _HEX64.fullmatch(ns_hex):
        raise ValueError(f"a namespace digest is 64 lowercase hex digits, got {ns_hex!r}")
    return "ns-" + ns_hex


def namespace_dir(root: str, ns_hex: str) -> str:
    return os.path.join(root, namespace_name(ns_hex))


def parse_namespace_dir(name: str) -> str | None:
    """The digest hex of a namespace folder name, or None for any other name."""
    match = _NS_DIR.fullmatch(name)
    return match.group(1) if match else None


def leaf_dir(ns_dir: str, keyhex: str) -> str:
    """`ns_dir/ab/cd` for a key whose hex starts `abcd` (`ns_dir` a path, or the namespace
    folder's name for the leaf's path relative to the root). Built with an f-string, not
    `os.path.join`: a lookup asks for it at every 16-token block end of a prompt that misses
    (2,047 times at 32k tokens), and the join was half the cost of each probe."""
    return f"{ns_dir}/{keyhex[0:2]}/{keyhex[2:4]}"


def part_name(keyhex: str, part: int) -> str:
    return f"{keyhex}.p{part}.blk"


def part_prefix(keyhex: str) -> str:
    """What every part file name of the entry starts with."""
    return keyhex + ".p"


def marker_name(keyhex: str) -> str:
    return keyhex + ".ok"


def parse_name(name: str) -> tuple[str, int | None] | None:
    """(key hex, part) of a part file, (key hex, None) of a marker, None for any other name."""
    match = _FILE.fullmatch(name)
    if match is None:
        return None
    if match.group(3):
        return match.group(1), None
    return match.group(1), int(match.group(2))
