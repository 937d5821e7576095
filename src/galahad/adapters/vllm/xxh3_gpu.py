"""Format v1's checksum frame tags computed on the GPU from a device copy: XXH3-128 with each
frame's seed, bit for bit what `xxhash` gives, by two Triton kernels.

Used by the direct load path (`direct.py`, `GALAHAD_DIRECT_LOADS=1`): plain frames are read into
pinned memory unhashed and verified on the GPU from their copy there, where the host would
otherwise read every byte a second time to hash it (docs/performance.md, GPU, twenty-fourth
session).

How: XXH3's long-input loop (xxhash.h, `XXH3_hashLong_internal_loop`) adds to its eight
accumulators within a 1 KiB block (16 stripes of 64 bytes) without reading them, so
`_block_sums` computes what every block adds at once, in parallel, as the payload's chunks land
on the device (a frame's last block, with its last stripe under the last-stripe key, included:
for a frame of whole KiB that stripe is the block's sixteenth). Between blocks the accumulators
are scrambled, which is not associative: `_frame_accs` runs that loop over the sums (4,095 steps
for a 4 MiB frame), every frame at once, when the whole payload is there. The host merges each
frame's accumulators into its tag (`XXH3_finalizeLong_128b`), every frame at once with numpy.
A seed changes the secret (`XXH3_initCustomSecret`): even secret words + seed, odd - seed.
`bench/gpu_hash.py check` compares it with `xxhash` (through Triton's interpreter in CI).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "FrameHasher", "frame_tags"]

M64 = (1 << 64) - 1
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5, MX1 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5, 0x165667919E3779F9
INIT_ACC = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)
KSECRET = bytes.fromhex(  # XXH3_kSecret, xxhash.h
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
BLOCK = 1024  # bytes a block: 16 stripes of 64 (the default secret's 192 bytes)
BLOCKS_A_PROGRAM = 16
FRAME_TILE = 16  # block sums `_frame_accs` loads at once


def _signed(u: int) -> int:
    """An unsigned 64-bit value as the int64 torch stores (same bits)."""
    return u - (1 << 64) if u >= 1 << 63 else u


@triton.jit
def _block_sums(data, kwords, seeds, last_keys, sums, first_block, n_blocks, blocks_per_frame, total_blocks,
                BPP: tl.constexpr):
    """For the blocks first_block.. of the payload (`data` holds them from its start): sums[b,
    lane] = what block b's 16 stripes add to accumulator `lane` (`XXH3_scalarRound`): lo32 * hi32
    of (data ^ key), plus the data words of the lane beside it (`lane ^ 1`). A frame's last block
    reads its sixteenth stripe (the frame's last 64 bytes) with the last-stripe key."""
    # the tensors are int64 (every torch has it); the arithmetic is on the same bits as uint64
    data = data.to(tl.pointer_type(tl.uint64), bitcast=True)
    kwords = kwords.to(tl.pointer_type(tl.uint64), bitcast=True)
    seeds = seeds.to(tl.pointer_type(tl.uint64), bitcast=True)
    last_keys = last_keys.to(tl.pointer_type(tl.uint64), bitcast=True)
    sums = sums.to(tl.pointer_type(tl.uint64), bitcast=True)
    pid = tl.program_id(0)
    b = (pid * BPP + tl.arange(0, BPP)).to(tl.int64)  # blocks of this program, from `data`'s start
    s = tl.arange(0, 16)  # stripe in the block
    lane = tl.arange(0, 8)
    ok = b < n_blocks
    g = first_block + b  # the block in the payload
    f = g // blocks_per_frame
    last = (((g % blocks_per_frame) == blocks_per_frame - 1) | (g == total_blocks - 1)) & ok
    words = b[:, None, None] * 128 + s[None, :, None] * 8 + lane[None, None, :]
    d = tl.load(data + words, mask=ok[:, None, None], other=0)
    seed = tl.load(seeds + f, mask=ok, other=0)
    k_index = s[:, None] + lane[None, :]  # stripe s reads secret words s..s+7
    k = tl.load(kwords + k_index)
    even = (k_index % 2) == 0
    key = tl.where(even[None, :, :], k[None, :, :] + seed[:, None, None], k[None, :, :] - seed[:, None, None])
    lk = tl.load(last_keys + f[:, None] * 8 + lane[None, :], mask=last[:, None], other=0)
    key = tl.where(last[:, None, None] & (s[None, :, None] == 15), lk[:, None, :], key)
    dk = d ^ key
    prod = (dk & 0xFFFFFFFF) * (dk >> 32)
    beside = tl.reshape(tl.flip(tl.reshape(tl.sum(d, axis=1), (BPP, 4, 2)), 2), (BPP, 8))  # lane ^ 1
    out = g[:, None] * 8 + lane[None, :]
    tl.store(sums + out, tl.sum(prod, axis=1) + beside, mask=ok[:, None])


@triton.jit
def _frame_accs(kwords, seeds, sums, accs, blocks_per_frame, total_blocks, TILE: tl.constexpr):
    """One frame's accumulators: its blocks' sums added and scrambled in order, the last one
    added only (`XXH3_hashLong_internal_loop`: the last partial block and last stripe). The sums
    are loaded TILE blocks at a time ahead of the loop that needs them, so the dependent chain of
    scrambles never waits on memory (a load a step took 4 ms a frame: twenty-fourth session)."""
    kwords = kwords.to(tl.pointer_type(tl.uint64), bitcast=True)
    seeds = seeds.to(tl.pointer_type(tl.uint64), bitcast=True)
    sums = sums.to(tl.pointer_type(tl.uint64), bitcast=True)
    accs = accs.to(tl.pointer_type(tl.uint64), bitcast=True)
    f = tl.program_id(0)
    lane = tl.arange(0, 8)
    rows = tl.arange(0, TILE)
    seed = tl.load(seeds + f)
    even = (lane % 2) == 0
    scr = tl.load(kwords + 16 + lane)  # the scramble key: secret bytes 128..191
    scr = tl.where(even, scr + seed, scr - seed)
    acc = tl.load(accs + f * 8 + lane)  # the initial accumulators, set by the host
    first = f.to(tl.int64) * blocks_per_frame  # this frame's first block
    nb = tl.minimum(total_blocks - first, blocks_per_frame)
    for t0 in range(0, nb - 1, TILE):
        m = (t0 + rows) < nb - 1
        tile = tl.load(sums + (first + t0 + rows)[:, None] * 8 + lane[None, :], mask=m[:, None], other=0)
        for j in tl.static_range(TILE):
            row = tl.sum(tl.where(rows[:, None] == j, tile, 0), axis=0)
            a = acc + row
            a = a ^ (a >> 47)
            a = a ^ scr
            a = a * 0x9E3779B1
            acc = tl.where(t0 + j < nb - 1, a, acc)
    acc = acc + tl.load(sums + (first + nb - 1) * 8 + lane)
    tl.store(accs + f * 8 + lane, acc)


_M32 = numpy.uint64(0xFFFFFFFF)


def _mul128_fold(a: numpy.ndarray, b: numpy.ndarray) -> numpy.ndarray:
    """XXH3_mul128_fold64 element-wise: low ^ high 64 bits of the 128-bit product (uint64 arrays,
    by 32-bit halves: numpy has no 128-bit integers)."""
    a0, a1, b0, b1 = a & _M32, a >> numpy.uint64(32), b & _M32, b >> numpy.uint64(32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> numpy.uint64(32)) + (p01 & _M32) + (p10 & _M32)
    lo = (p00 & _M32) | (mid << numpy.uint64(32))
    hi = p11 + (p01 >> numpy.uint64(32)) + (p10 >> numpy.uint64(32)) + (mid >> numpy.uint64(32))
    return lo ^ hi


def _merge(accs: numpy.ndarray, keys: numpy.ndarray, start: numpy.ndarray) -> numpy.ndarray:
    """`XXH3_mergeAccs` of every frame at once: accs (n, 8), keys (n, 8) the secret's words from
    the merge's offset, start (n,); all uint64."""
    r = start + _mul128_fold(accs[:, 0::2] ^ keys[:, 0::2], accs[:, 1::2] ^ keys[:, 1::2]).sum(axis=1, dtype=numpy.uint64)
    r ^= r >> numpy.uint64(37)
    r *= numpy.uint64(MX1)
    return r ^ (r >> numpy.uint64(32))


def _secrets(seeds: Sequence[int]) -> numpy.ndarray:
    """Every frame's secret (`XXH3_initCustomSecret`), one row of 192 bytes each."""
    base = numpy.frombuffer(KSECRET, dtype="<u8")
    s = numpy.array([x & M64 for x in seeds], dtype=numpy.uint64)[:, None]
    even = (numpy.arange(24) % 2 == 0)[None, :]
    return numpy.where(even, base[None, :] + s, base[None, :] - s).astype("<u8").view(numpy.uint8).reshape(-1, 192)


class FrameHasher:
    """The tags of a payload of `payload_len` bytes cut into frames of `frame_size` (the last one
    shorter), one seed a frame, hashed chunk by chunk as the payload reaches the device.

    `add(chunk, offset)` queues the block sums of the payload bytes `offset..` that `chunk` (on
    the device) holds, on the current stream, nothing waiting; chunks may come in any order but
    must start and end on a 1 KiB boundary (or the payload's end) and together cover it.
    `tags()`, on the same stream, runs every frame's loop and waits once for the tags.
    `fits(payload_len, frame_size)`: whether every frame is a whole number of KiB (the kernels'
    shape); the payload then takes `sums_bytes` of device memory while it is hashed.
    """

    def __init__(self, payload_len: int, frame_size: int, seeds: Sequence[int], device: torch.device | str) -> None:
        if not self.fits(payload_len, frame_size) or len(seeds) != -(-payload_len // frame_size):
            raise ValueError("frames of whole KiB, one seed each")
        self.payload_len, self.frame_size = payload_len, frame_size
        self.lens = [min(frame_size, payload_len - i * frame_size) for i in range(len(seeds))]
        sec = _secrets(seeds)
        self.total_blocks = payload_len // BLOCK
        # the merge's secret words (from byte 11 for the low half, 117 for the high one) and starts
        self._keys_lo = numpy.ascontiguousarray(sec[:, 11 : 11 + 64]).view("<u8")
        self._keys_hi = numpy.ascontiguousarray(sec[:, 117 : 117 + 64]).view("<u8")
        lens = numpy.array(self.lens, dtype=numpy.uint64)
        self._start_lo = lens * numpy.uint64(P64_1)
        self._start_hi = ~(lens * numpy.uint64(P64_2))
        kwords = torch.from_numpy(numpy.frombuffer(KSECRET, dtype="<i8").copy())
        seed_t = torch.tensor([_signed(s) for s in seeds], dtype=torch.int64)
        last = torch.from_numpy(numpy.ascontiguousarray(sec[:, 192 - 64 - 7 : 192 - 7]).view("<i8").copy())
        accs = torch.tensor([[_signed(a) for a in INIT_ACC]] * len(seeds), dtype=torch.int64)
        # one copy of the constants (the kernels' arguments) on the current stream, from pinned
        # memory on CUDA: an ordinary copy would wait for everything queued on the device first
        packed = torch.cat([kwords, seed_t, last.view(-1), accs.view(-1)])
        if torch.device(device).type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        n = len(seeds)
        self._kwords, self._seeds = packed[:24], packed[24 : 24 + n]
        self._last, self._accs = packed[24 + n : 24 + 9 * n], packed[24 + 9 * n :]
        self._sums = torch.empty((self.total_blocks, 8), dtype=torch.int64, device=device)
        self._covered = 0

    @staticmethod
    def fits(payload_len: int, frame_size: int) -> bool:
        return payload_len > 0 and payload_len % BLOCK == 0 and frame_size % BLOCK == 0

    @staticmethod
    def sums_bytes(payload_len: int) -> int:
        return payload_len // BLOCK * 64

    def add(self, chunk: torch.Tensor, offset: int) -> None:
        n = chunk.numel()
        if offset % BLOCK or (n % BLOCK and offset + n != self.payload_len) or offset + n > self.payload_len:
            raise ValueError(f"a chunk of {n} bytes at {offset} is not on 1 KiB boundaries of the payload")
        blocks = n // BLOCK
        if blocks == 0:
            return
        _block_sums[(triton.cdiv(blocks, BLOCKS_A_PROGRAM),)](
            chunk.view(torch.int64), self._kwords, self._seeds, self._last, self._sums, offset // BLOCK, blocks,
            self.frame_size // BLOCK, self.total_blocks, BPP=BLOCKS_A_PROGRAM)
        self._covered += n

    def tags(self) -> list[bytes]:
        if self._covered != self.payload_len:
            raise ValueError(f"{self._covered} of {self.payload_len} payload bytes were added")
        _frame_accs[(len(self.lens),)](self._kwords, self._seeds, self._sums, self._accs,
                                       self.frame_size // BLOCK, self.total_blocks, TILE=FRAME_TILE, num_warps=1)
        accs = self._accs.view(-1, 8).cpu().numpy().view(numpy.uint64)
        with numpy.errstate(over="ignore"):
            lo = _merge(accs, self._keys_lo, self._start_lo)
            hi = _merge(accs, self._keys_hi, self._start_hi)
        raw = numpy.stack([hi, lo], axis=1).astype(">u8").tobytes()  # canonical: big-endian high, low
        return [raw[16 * i : 16 * i + 16] for i in range(len(self.lens))]


def frame_tags(payload: torch.Tensor, frame_size: int, seeds: Sequence[int]) -> list[bytes]:
    """The tag of each frame of `payload` (uint8, contiguous, on one device): what
    `xxhash.xxh3_128_digest(frame, seed=s)` gives."""
    h = FrameHasher(payload.numel(), frame_size, seeds, payload.device)
    h.add(payload, 0)
    return h.tags()
