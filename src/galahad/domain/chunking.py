"""Where saving and sharing points fall in a prompt.

`layer` order: one entry per saved prompt prefix (block-aligned), reusable when a later prompt
starts with that whole prefix. `chunk` order: an entry every 64 tokens, so any shared beginning is
reusable. Prompts shorter than the minimum are neither saved nor looked up.
"""

from __future__ import annotations

import attrs

from galahad.domain.error import ConfigError
from galahad.domain.namespace import PayloadOrder

__all__ = ["CHUNK_TOKENS", "DEFAULT_MIN_TOKENS", "Chunking", "Span"]

CHUNK_TOKENS = 64
DEFAULT_MIN_TOKENS = 256


@attrs.frozen
class Span:
    """The tokens `[start, end)` one entry holds; its key is the chain key of `tokens[:end]`."""

    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@attrs.frozen
class Chunking:
    """Saving points for one engine block size and payload order.

    In `chunk` order the step is 64 tokens when the block size divides 64. For coarser blocks
    (hybrid models, 128- or 256-token blocks) that are multiples of 64, the step is the block size
    and `is_fallback` is True (counted as `saver_chain_fallback`). Any other block size is refused.
    """

    order: PayloadOrder
    block_size: int
    min_tokens: int = DEFAULT_MIN_TOKENS

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block size must be positive, got {self.block_size}")
        if self.min_tokens < 0:
            raise ConfigError(f"GALAHAD_MIN_TOKENS={self.min_tokens} is negative; use 0 or more")
        if self.order is PayloadOrder.CHUNK and (
            CHUNK_TOKENS % self.block_size and self.block_size % CHUNK_TOKENS
        ):
            raise ConfigError(
                f"GALAHAD_PAYLOAD_ORDER=chunk needs a block size that divides {CHUNK_TOKENS} "
                f"or is a multiple of it; the engine uses {self.block_size}. Use "
                "GALAHAD_PAYLOAD_ORDER=layer or change the engine block size."
            )

    @property
    def step(self) -> int:
        """Granularity of saving points, in tokens (also the chain key step)."""
        if self.order is PayloadOrder.LAYER:
            return self.block_size
        return max(CHUNK_TOKENS, self.block_size)

    @property
    def is_fallback(self) -> bool:
        """True when `chunk` order could not use 64-token sharing points for this block size."""
        return self.order is PayloadOrder.CHUNK and self.block_size > CHUNK_TOKENS

    def eligible(self, num_tokens: int) -> bool:
        return num_tokens >= max(self.min_tokens, self.step)

    def save_spans(self, num_tokens: int) -> list[Span]:
        """The entries to write for a prompt of `num_tokens` computed tokens (empty if too short)."""
        if not self.eligible(num_tokens):
            return []
        end = num_tokens // self.step * self.step
        if self.order is PayloadOrder.LAYER:
            return [Span(0, end)]
        return [Span(s, s + self.step) for s in range(0, end, self.step)]

    def probe_ends(self, num_tokens: int, *, leave_one: bool = True) -> list[int]:
        """Candidate entry ends for a lookup, longest first (at least one token left to compute)."""
        if not self.eligible(num_tokens):
            return []
        limit = num_tokens - 1 if leave_one else num_tokens
        top = limit // self.step * self.step
        return list(range(top, 0, -self.step))

    def span_ending_at(self, end: int) -> Span:
        if end % self.step:
            raise ValueError(f"{end} is not a saving point (step {self.step})")
        if self.order is PayloadOrder.LAYER:
            return Span(0, end)
        return Span(end - self.step, end)

    def key_index(self, end: int) -> int:
        """Index into `chain_keys(seed, tokens, step)` of the key for the prefix ending at `end`."""
        return end // self.step - 1
