"""Parts read and verified, or sealed and written, in helper processes: work that does not queue
on the engine process's interpreter lock.

A chunk-order load job reads many parts at once (one per 64 tokens), and a step's saves seal as
many. In one process each piece read, hashed, encrypted or written is a round trip through the
interpreter lock, shared with the engine's own thread: on an H200 a new 2k-token prompt took 1.8x
as long as without Galahad while the prompt before it was sealed and written in the engine
process, 1.04x with its save copied out but neither sealed nor written (docs/benchmarks.md,
GPU). `HelperPool` runs helper processes (this
module run as a program), each with its own interpreter lock, over one `SharedRegion` (a memfd
both processes map; the engine process pins it for the GPU):
- a reader pool (`open_part`) reads a part straight into the region and verifies it there, by
  the same `codec.open_part_from` as in process; only its header comes back;
- a writer pool (`seal_and_place`) seals a part whose payload the GPU copied into the region, by
  the same `codec.seal_part` as in process, into a new temp file of the part's folder, and gives
  it its name, durably (`galahad.adapters.posix.atomic`); only whether it did comes back.

The engine process still opens the part's folder through the store: the store's every folder
check, its size cap and its record of use stay with it, and the part's file is made and named
only inside the folder the store checked. The folder's descriptor (a reader gets the part's
file's) is handed to the helper over a Unix socket (SCM_RIGHTS), so a helper needs neither the
store nor the licence, only the descriptor, the region and the ciphers (`HelperRecipe`, sent once
at start over the same socket, never in argv or the environment). The file's steps (creating,
writing, fsync, link, fsync of the folder) are then system calls of the writer, not of the
engine process, where each would release and retake the interpreter lock the engine's thread
shares, for each of the dozens of parts a step of a long prompt saves.

The same errors as the codec come back for the same bytes (a damaged frame is an
`IntegrityError`, a write the disk refused an `OSError` with its errno, and so on), so the
service counts and quarantines exactly as it does in process. A helper that dies, hangs past
`_REPLY_TIMEOUT_S` (a writer longer, by the size of its part) or answers nonsense raises
`HelperLost`. The pool then stops for good, logged once, and the caller reads or seals the part in
process instead: the pool never fails a request.
"""

from __future__ import annotations

import errno
import functools
import logging
import mmap
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

import galahad
from galahad.format import codec
from galahad.adapters.posix import readhash
from galahad.adapters.posix.atomic import CREATE, write_atomically
from galahad.adapters.posix.memory import kernel_zeroed
from galahad.adapters.posix.vectored import pwritev_all
from galahad.domain.error import (
    FormatError,
    ForeignBlock,
    GalahadError,
    HelperLost,
    IntegrityError,
    StoreUnavailable,
    UnknownKey,
)
from galahad.format.v1 import BlockHeader, Segment, decode_header
from galahad.ports.helpers import HelperRecipe
from galahad.ports.store import read_stepwise

__all__ = ["HelperLost", "HelperPool", "HelperRecipe", "SharedRegion"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # a helper imports the codec and its ciphers, then says it is ready
_REPLY_TIMEOUT_S = 30.0  # one part (tens of MB from the page cache) takes milliseconds
_SLOWEST_WRITE = 20 << 20  # bytes a second: a writer is given 30 s and this long per byte it writes
# (a 4.8 GB part of a 32k-token prompt into a disk that far behind takes minutes, and is no hang)
_SEAL_KEPT = 256 << 20  # a writer keeps its buffer for sealed frames up to this size
_BOOT = ("import runpy, sys; sys.path.append(sys.argv.pop(1)); "
         "runpy.run_module('galahad.adapters.helpers.pool', run_name='__main__', alter_sys=True)")
_WAIT_S = 0.2  # a caller waiting for an idle helper looks this often whether the pool is off
_MESSAGE = 1 << 20  # the largest message either way (a header, an error text, a recipe)
_CODE = str(Path(galahad.__file__).resolve().parent)  # the package a helper must run: this process's
_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (IntegrityError, ForeignBlock, UnknownKey, FormatError, StoreUnavailable)
}


class SharedRegion:
    """`size` bytes of shared memory (a memfd), mapped here; helpers map the same descriptor."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"a shared region needs a positive size, got {size}")
        self.size = size
        self.fd = os.memfd_create("galahad-region", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)  # unmapped with the last reference to it (pinned
        # memory in the engine process: kept for the life of the worker)


class _Helper:
    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.segments: dict[int, tuple[Segment, ...]] = {}  # the segment tables it sent, by number
        self.inbox = bytearray(_MESSAGE)  # its replies land here (no buffer made per reply)
        self.timeout: float | None = socket.getdefaulttimeout()  # its socket's timeout now, as made


_WORK = {"read": ("reader", "read"), "write": ("writer", "sealed and written")}  # a pool's name and what
# its callers do in process once it is off


class HelperPool:
    """`processes` helpers over `region`: reading parts into it (`work="read"`, `open_part`) or
    sealing and writing parts from it (`work="write"`, `seal_and_place`); thread-safe: a caller
    takes an idle helper, or waits for one."""

    def __init__(self, region: SharedRegion, recipe: HelperRecipe, processes: int, *, work: str = "read") -> None:
        if work not in _WORK:
            raise ValueError(f"a helper pool reads or writes, not {work!r}")
        self.region = region
        self.processes = processes
        self.work = work
        self._name, self._fallback = _WORK[work]
        self._idle: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        self._helpers: list[_Helper] = []
        self._lock = threading.Lock()
        self._off = ""
        self.parts_read = 0  # parts a helper read and verified (the rest were read in process)
        self.parts_written = 0  # parts a helper sealed and wrote
        # where a part's time went: waiting for an idle helper, from sending the job to holding
        # the reply, and the helpers' own time reading and verifying, or sealing and writing
        self.take_seconds = self.ask_seconds = self.helper_seconds = 0.0
        try:
            for _ in range(processes):
                self._helpers.append(self._spawn())
            blob = pickle.dumps(recipe)
            for helper in self._helpers:  # all start side by side; each says it is ready
                _send(helper.sock, blob)
            for helper in self._helpers:
                reply = _receive(helper, _START_TIMEOUT_S)
                if reply != ("ready", _CODE):
                    if isinstance(reply, tuple) and reply[:1] == ("failed",):
                        why = reply[1]
                    elif isinstance(reply, tuple) and reply[:1] == ("ready",) and len(reply) == 2:
                        # another copy of this package (another version, another format): never mixed
                        why = f"it runs the Galahad code in {reply[1]}, this process the one in {_CODE}"
                    else:
                        why = repr(reply)
                    raise HelperLost(f"a {self._name} process did not start: {why}")
                self._idle.put(helper)
        except BaseException:
            self.close()
            raise
        # A child forked from this process (not exec'd) must not keep the helpers' sockets open:
        # the helpers stop when this process goes away only if no other process holds them.
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _forget(self) -> None:
        """In a forked child: close this pool's sockets, leave the helpers to their parent."""
        self._off = "forked"
        for helper in self._helpers:
            try:
                helper.sock.close()
            except OSError:
                pass
        self._helpers = []

    def _spawn(self) -> _Helper:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The folder holding this package goes at the end of the helper's sys.path: found even
        # when this process put it on its path itself, never shadowing the standard library
        here = str(Path(galahad.__file__).resolve().parents[1])
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, here, str(theirs.fileno()), str(self.region.fd),
                 str(self.region.size)],
                pass_fds=(theirs.fileno(), self.region.fd), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        return _Helper(proc, mine)

    @property
    def running(self) -> bool:
        return not self._off

    def open_part(self, fd: int, size: int, offset: int, out: memoryview, expect: codec.Expect) -> codec.OpenedPart:
        """`codec.open_part_from` of the part open on `fd` (`size` bytes), into `out`, which must
        be the region's bytes from `offset` on. Raises what that raises for the same bytes, or
        `HelperLost` (the pool is off; read the part in process)."""
        if self._off:
            raise HelperLost(self._off)
        if offset < 0 or offset + len(out) > self.region.size:
            raise ValueError(f"bytes {offset}..{offset + len(out)} are not inside the {self.region.size}-byte region")
        reply = self._ask(("read", size, offset, len(out), expect), fd)
        if isinstance(reply, tuple) and reply[:1] == ("ok",) and len(reply) == 3 and isinstance(reply[2], float):
            header = reply[1]
            with self._lock:
                self.parts_read += 1
                self.helper_seconds += reply[2]
            return codec.OpenedPart(header, out.cast("B")[: header.payload_len])
        if isinstance(reply, tuple) and reply[:1] == ("error",) and len(reply) == 3 and reply[1] in _ERRORS:
            raise _ERRORS[reply[1]](reply[2])
        if isinstance(reply, tuple) and reply[:1] == ("failed",) and len(reply) == 2:
            raise RuntimeError(f"a reader process could not read a part: {reply[1]}")
        self._lose(f"a reader process answered {reply!r:.200}", None)
        raise HelperLost(self._off)

    def seal_and_place(self, dir_fd: int, name: str, tick_ns: int, size: int, header: bytes, offset: int,
                       sizes: Sequence[int]) -> bool:
        """`codec.seal_part` of the part whose encoded header (before sealing) is `header` and
        whose segments of `sizes` bytes lie one after another in the region from `offset` on,
        sealed by the cipher of the helpers' recipe that the header's cipher and key ids name,
        written as the file `name` of the folder open on `dir_fd` by a writer process, as
        `galahad.adapters.posix.atomic.write_atomically` writes it (stamped with `tick_ns`,
        durable; the caller has just found the name absent): whether it was given the name (False:
        taken meanwhile). A sealed part of another count than `size` bytes is never given it.
        Raises what sealing raises for the same payload, `OSError` with its errno where the disk
        or the folder refused a step, or `HelperLost` (the pool is off; seal the part in process)."""
        if self._off:
            raise HelperLost(self._off)
        end = offset + sum(sizes)
        if offset < 0 or end > self.region.size:
            raise ValueError(f"bytes {offset}..{end} are not inside the {self.region.size}-byte region")
        reply = self._ask(("place", header, offset, tuple(sizes), size, name, tick_ns), dir_fd,
                          _REPLY_TIMEOUT_S + (end - offset) / _SLOWEST_WRITE)
        if isinstance(reply, tuple) and reply[:1] == ("ok",) and len(reply) == 3 and isinstance(reply[1], bool):
            with self._lock:
                self.parts_written += reply[1]
                self.helper_seconds += reply[2]
            return reply[1]
        if isinstance(reply, tuple) and reply[:1] == ("error",) and len(reply) == 3 and reply[1] in _ERRORS:
            raise _ERRORS[reply[1]](reply[2])
        if isinstance(reply, tuple) and reply[:1] == ("oserror",) and len(reply) == 3 and isinstance(reply[1], int):
            raise OSError(reply[1], reply[2])
        if isinstance(reply, tuple) and reply[:1] == ("failed",) and len(reply) == 2:
            raise RuntimeError(f"a writer process could not write a part: {reply[1]}")
        self._lose(f"a writer process answered {reply!r:.200}", None)
        raise HelperLost(self._off)

    def _ask(self, job: tuple[Any, ...], fd: int, timeout: float | None = None) -> Any:
        """`job` and a copy of `fd` to an idle helper, and its reply within `timeout` seconds
        (`_REPLY_TIMEOUT_S` when None); `HelperLost` (the pool is off from now on) when it fails
        to answer."""
        t0 = time.perf_counter()
        helper = self._take()
        t1 = time.perf_counter()
        try:
            socket.send_fds(helper.sock, [pickle.dumps(job)], [fd])
            reply = _settle(helper, _receive(helper, _REPLY_TIMEOUT_S if timeout is None else timeout))
        except BaseException as exc:
            self._lose(f"a {self._name} process failed ({type(exc).__name__}: {exc})", helper)
            raise HelperLost(self._off) from exc
        self._idle.put(helper)
        t2 = time.perf_counter()
        with self._lock:
            self.take_seconds += t1 - t0
            self.ask_seconds += t2 - t1
        return reply

    def _take(self) -> _Helper:
        """An idle helper; `HelperLost` once the pool is off (a lost helper never comes back, so
        a caller waiting for one must not wait for ever)."""
        while True:
            try:
                helper = self._idle.get(timeout=_WAIT_S)
            except queue.Empty:
                if self._off:
                    raise HelperLost(self._off) from None
                continue
            if self._off:
                self._idle.put(helper)
                raise HelperLost(self._off)
            return helper

    def _lose(self, why: str, helper: _Helper | None) -> None:
        with self._lock:
            first = not self._off
            self._off = self._off or why
        if first:
            log.warning("[galahad] %s processes OFF: %s; parts are %s in this process from now on", self._name, why,
                        self._fallback)
        if helper is not None:
            _stop(helper)

    def pids(self) -> list[int]:
        """The helpers' process ids."""
        return [h.proc.pid for h in self._helpers]

    def close(self) -> None:
        """Stop every helper (they also stop by themselves when this process goes away)."""
        with self._lock:
            self._off = self._off or "closed"
            helpers, self._helpers = self._helpers, []
        for helper in helpers:
            _stop(helper)


def _forget_in_child(ref: weakref.ref[HelperPool]) -> None:
    pool = ref()
    if pool is not None:
        pool._forget()


def _stop(helper: _Helper) -> None:
    try:
        helper.sock.close()
    except OSError:
        pass
    try:
        helper.proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        helper.proc.kill()
        helper.proc.wait()


# A part's header comes back as its fields, in attrs order, with its segment table as a number: a
# table is sent whole only the first time (a deployment has one or two). Unpickling 36 Segments
# each part took 39% of the interpreter-lock time of the engine process's reading threads on a
# 16-core GPU host. Past `_TABLES` tables (parts of many shapes)
# a new one comes whole, unnumbered, every time: neither side's record grows without end.
_FIELDS = tuple(f.name for f in attrs.fields(BlockHeader))
_AT = _FIELDS.index("segments")
_TABLES = 256


def _compact(header: BlockHeader, sent: dict[tuple[Segment, ...], int]) -> tuple[tuple[Any, ...], Any]:
    """In a helper: `header` as (its fields but the segments, the table's number, or (number,
    table) the first time, or (-1, table) once `_TABLES` are numbered)."""
    table = header.segments
    ref: Any = sent.get(table)
    if ref is None:
        number = -1
        if len(sent) < _TABLES:
            number = sent[table] = len(sent)
        ref = (number, table)
    state = attrs.astuple(header, recurse=False)
    return state[:_AT] + state[_AT + 1 :], ref


def _settle(helper: _Helper, reply: Any) -> Any:
    """A read's reply as `open_part` takes it: ("ok", header, seconds); any other reply as it came.
    Runs while the caller still holds `helper` (its tables are filled in reply order)."""
    if not (isinstance(reply, tuple) and reply[:1] == ("ok",) and len(reply) == 4):
        return reply
    _ok, fields, ref, seconds = reply
    table: tuple[Segment, ...] | None = None
    if isinstance(ref, tuple) and len(ref) == 2 and isinstance(ref[0], int) and isinstance(ref[1], tuple):
        number, table = ref
        if number >= 0:
            helper.segments[number] = table
    elif isinstance(ref, int):
        table = helper.segments.get(ref)
    if table is None or not isinstance(fields, tuple) or len(fields) != len(_FIELDS) - 1:
        return ("nonsense", fields, ref)
    header = BlockHeader.__new__(BlockHeader)
    # what unpickling a header does (attrs' own __setstate__): the helper decoded and checked it
    header.__setstate__(dict(zip(_FIELDS, (*fields[:_AT], table, *fields[_AT:]))))
    return ("ok", header, seconds)


def _send(sock: socket.socket, blob: bytes) -> None:
    if len(blob) > _MESSAGE:
        raise ValueError(f"a {len(blob)}-byte message is over the {_MESSAGE}-byte limit")
    sock.sendall(blob)


def _receive(helper: _Helper, timeout: float | None) -> Any:
    """The helper's next message, waited for `timeout` seconds at most (None: for ever). The
    socket's timeout is set only when it changes, and the message lands in the helper's inbox:
    a part saved costs the engine process two system calls fewer."""
    if timeout != helper.timeout:
        helper.sock.settimeout(timeout)
        helper.timeout = timeout
    count = helper.sock.recv_into(helper.inbox)
    if not count:
        raise HelperLost("a helper process closed its socket")
    return pickle.loads(memoryview(helper.inbox)[:count])


# -- the helper process ---------------------------------------------------------------------------


class _DescriptorReader:
    """A `PartReader` over a descriptor the engine process opened (buffered reads)."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd, self.size = fd, size

    def preadv(self, offset: int, buffers: Sequence[memoryview]) -> int:
        done, views = 0, [memoryview(b).cast("B") for b in buffers]
        for view in views:
            while len(view):
                try:
                    got = os.preadv(self._fd, [view], offset + done)
                except OSError as exc:
                    raise StoreUnavailable(f"a reader process could not read a part: {exc}") from exc
                if got == 0:
                    return done
                done, view = done + got, view[got:]
        return done

    def close(self) -> None:
        """The descriptor is `_serve`'s to close (after the reply)."""

    def __enter__(self) -> _DescriptorReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def read_stepwise(self, offset: int, view: memoryview, step: int, each: Callable[[memoryview], object]) -> int:
        return read_stepwise(self, offset, view, step, each)  # no lock to share: the reference loop

    def read_hashed(self, offset: int, view: memoryview, seed: int) -> tuple[int, bytes] | None:
        """`HashedReader.read_hashed` through the compiled loop where it was built (each piece
        hashed in cache, smaller than the Python loop's 512 KiB)."""
        if not readhash.available() or type(offset) is not int or offset < 0:
            return None
        try:
            return readhash.read_hashed(self._fd, offset, memoryview(view).cast("B"), seed)
        except OSError as exc:
            raise StoreUnavailable(f"a reader process could not read a part: {exc}") from exc


def _serve(sock: socket.socket, region: memoryview) -> None:
    try:
        ciphers = pickle.loads(sock.recv(_MESSAGE)).ciphers()
    except Exception as exc:  # noqa: BLE001 - said to the engine process, which logs it
        _send(sock, pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        return
    _send(sock, pickle.dumps(("ready", _CODE)))
    sent: dict[tuple[Segment, ...], int] = {}  # the segment tables sent so far (`_compact`)
    sealing = _SealBuffer()
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, _MESSAGE, 1)
        if not msg:
            return  # the engine process closed the pool or went away
        t0 = time.perf_counter()
        reply: tuple[Any, ...]
        try:
            job = pickle.loads(msg)
            if job[0] == "place":
                _work, header, offset, sizes, size, name, tick_ns = job
                placed = _place(fds[0], name, tick_ns, size, lambda fd: _write(fd, region, ciphers, header, offset,
                                                                               sizes, sealing))
                reply = ("ok", placed, time.perf_counter() - t0)
            else:
                _work, size, offset, nbytes, expect = job
                # one part at a time, read in slices that stay in the core's cache while hashed
                opened = codec.open_part_from(_DescriptorReader(fds[0], size), expect=expect, ciphers=ciphers,
                                              out=region[offset : offset + nbytes], slice_bytes=codec.SMALL_SLICE)
                reply = ("ok", *_compact(opened.header, sent), time.perf_counter() - t0)
        except GalahadError as exc:
            name = type(exc).__name__
            reply = ("error", name, str(exc)) if name in _ERRORS else ("failed", f"{name}: {exc}")
        except OSError as exc:  # the disk refused a write: the engine process's store says where
            reply = ("oserror", exc.errno or 0, exc.strerror or str(exc))
        except Exception as exc:  # noqa: BLE001 - process boundary: the engine process decides
            reply = ("failed", f"{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
        _send(sock, pickle.dumps(reply))


class _SealBuffer:
    """A writer's buffer for sealed frames, kept between parts up to `_SEAL_KEPT` bytes (grown
    when a larger part comes). A larger part (a whole prompt in `layer` order) gets memory of its
    own, which goes back to the kernel once it is written: four writers never keep gigabytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def take(self, n: int) -> memoryview:
        if n > _SEAL_KEPT:
            return kernel_zeroed(n)  # unmapped with the last view of it
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]


def _place(dir_fd: int, name: str, tick_ns: int, size: int, write: Callable[[int], int]) -> bool:
    """`HelperPool.seal_and_place` in a writer: `write(fd)` seals the part into a new temp file
    of the folder open on `dir_fd`, which takes the name `name` only if it holds `size` bytes."""

    def fill(tmp: str) -> int:
        fd = os.open(tmp, CREATE, 0o600, dir_fd=dir_fd)
        try:
            written = write(fd)
            if written != size:
                raise OSError(errno.EIO, f"{written} bytes were written, not {size}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    return write_atomically(dir_fd, name, fill, tick_ns, replace=False, looked=True)


def _write(fd: int, region: memoryview, ciphers: codec.CipherLookup, header: bytes, offset: int,
           sizes: Sequence[int], sealing: _SealBuffer) -> int:
    """Seal the part of `header` from the region and write it into `fd` (`_place`): the bytes written."""
    plain = decode_header(header)
    cipher = ciphers(plain.cipher_id, plain.key_id)
    if cipher is None:
        raise UnknownKey(f"a writer process holds no cipher {plain.cipher_id} with key id {plain.key_id.hex()}")
    views, at = [], offset
    for n in sizes:
        views.append(region[at : at + n])
        at += n
    out = None if cipher.cipher_id == 0 else sealing.take(codec.sealed_len(plain))
    return pwritev_all(fd, [memoryview(c).cast("B") for c in codec.seal_part(plain, views, cipher, out=out)], 0)


def main(argv: Sequence[str]) -> None:
    sock_fd, region_fd, size = (int(a) for a in argv)
    sock = socket.socket(fileno=sock_fd)
    mapped = mmap.mmap(region_fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(region_fd)
    _serve(sock, memoryview(mapped))  # the mapping goes with the process


if __name__ == "__main__":
    main(sys.argv[1:])
