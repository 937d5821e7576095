"""Cipher 0: frames stored in the clear, each followed by an XXH3-128 checksum (spec §5.2).

It detects damage (bit rot, torn or misplaced writes, a frame moved to another file or index);
it is not a MAC and does not stop someone who can write the store on purpose. Use AES-256-GCM
(cipher 1) for that.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from galahad.domain.error import IntegrityError
from galahad.format.v1 import TAG_SIZE, Buffer, CipherId

__all__ = ["Xxh3FrameCheck"]


class Xxh3FrameCheck:
    """The keyless frame check, implementing the `Cipher` port (cipher id 0, key id all zero).

    tag(i) = XXH3-128(frame i, seed = XXH3-64(salt || header || u64le(i))), canonical byte order.
    """

    cipher_id: int = int(CipherId.XXH3)
    key_id: bytes = bytes(8)

    def tag(self, salt: bytes, aad: bytes, index: int, pieces: Iterable[Buffer]) -> bytes:
        """The tag of the frame made of `pieces` concatenated (no copy to join them).

        xxhash releases the interpreter lock while it hashes, so frames hash in parallel."""
        state = self.hasher(salt, aad, index)
        for piece in pieces:
            state.update(piece)
        return state.digest()

    def hasher(self, salt: bytes, aad: bytes, index: int) -> xxhash.xxh3_128:
        """The hash state of frame `index` before its bytes: `update` it with them, in order, and
        its `digest()` is the frame's tag."""
        return xxhash.xxh3_128(seed=self.seed(salt, aad, index))

    @staticmethod
    def seed(salt: bytes, aad: bytes, index: int) -> int:
        """Frame `index`'s XXH3-128 seed: its tag is `xxh3_128_digest(frame, seed=seed(...))`."""
        return xxhash.xxh3_64_intdigest(b"".join((salt, aad, index.to_bytes(8, "little"))))

    @staticmethod
    def check_digest(index: int, state: xxhash.xxh3_128, tag: Buffer) -> None:
        """`IntegrityError` unless `state` (a `hasher` fed frame `index`'s bytes) gives `tag`."""
        Xxh3FrameCheck.check_tag(index, state.digest(), tag)

    @staticmethod
    def check_tag(index: int, digest: bytes, tag: Buffer) -> None:
        """`IntegrityError` unless `digest` (frame `index`'s XXH3-128, canonical order, computed
        elsewhere with `seed(...)`) is `tag`."""
        if digest != tag:
            raise IntegrityError(f"frame {index} checksum does not match: the frame is damaged")

    def seal_frame(self, salt: bytes, aad: bytes, index: int, data: bytes | memoryview) -> bytes:
        return bytes(data) + self.tag(salt, aad, index, (data,))

    def open_frame(self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview) -> bytes:
        return bytes(self.check_frame(salt, aad, index, sealed))

    def open_frame_into(
        self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview, out: memoryview
    ) -> int:
        """`open_frame` writing the plaintext into `out`; returns the count written (one copy)."""
        data = self.check_frame(salt, aad, index, sealed)
        out[: len(data)] = data
        return len(data)

    def check_frame(self, salt: bytes, aad: bytes, index: int, sealed: bytes | memoryview) -> memoryview:
        """Verify a sealed frame in place; return a view of its plaintext (no copy)."""
        view = memoryview(sealed).cast("B")
        if len(view) < TAG_SIZE:
            raise IntegrityError(f"frame {index} is shorter than its tag")
        data = view[: len(view) - TAG_SIZE]
        state = self.hasher(salt, aad, index)
        state.update(data)
        self.check_digest(index, state, view[len(view) - TAG_SIZE :])
        return data

    def __repr__(self) -> str:
        return "Xxh3FrameCheck()"
