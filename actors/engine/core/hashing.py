"""Chained block hashes for prefix caching.

A block's hash covers its own token ids *and* every token before it, through the
parent hash:

    h0 = H(root,  tokens[0:bs],    extras_0)     extras_0 carries the cache_salt
    h1 = H(h0,    tokens[bs:2bs],  extras_1)
    h2 = H(h1,    tokens[2bs:3bs], extras_2)     ... only full blocks are hashed

so equal hashes mean equal prefixes. `H` is SHA-256 over a fixed byte layout
(32-byte parent, token ids as little-endian uint32, then tagged extra keys), and
`root` is derived from a seed string: the result is the same in every process and
on every machine, whatever PYTHONHASHSEED is. A router in another process computes
an engine's chain with `hash_block_tokens` / `BlockHasher` and the same seed.

Extra keys: an adapter id (every block, since an adapter changes all KV), a
per-tenant `cache_salt` (first block only: it changes the root of the chain, so
tenants never share a cached block), and multimodal items (hash + offset of each
item that overlaps the block).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from spur.configs.defaults import DEFAULT_HASH_SEED

BlockHash = bytes
"""32-byte SHA-256 digest of one full block and its whole prefix."""

_sha256 = hashlib.sha256
# Token ids go in as little-endian uint32; array('I') is native-endian, so swap
# on a big-endian host to keep the bytes identical everywhere.
_BIG_ENDIAN = array("I", [1]).tobytes() != b"\x01\x00\x00\x00"


def root_hash(seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """The parent hash of every chain's first block, derived from `seed`."""
    return _sha256(b"spur-root\x00" + seed.encode()).digest()


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request hashes with: its tenant's scope around its own `cache_salt`.

    No tenant (authentication off): `cache_salt` unchanged. With a tenant, the
    result starts with the tenant's length-prefixed name, so two tenants never
    produce the same salt (no shared KV or state blocks, hence no prefix-cache
    timing side channel between them), whatever `cache_salt` either sends, while
    the requests of one tenant with equal `cache_salt` still share:

        tenant_salt("acme", None)  -> "t4:acme"
        tenant_salt("acme", "x")   -> "t4:acme:x"
    """
    if tenant is None:
        return cache_salt
    scoped = f"t{len(tenant)}:{tenant}"
    return scoped if cache_salt is None else f"{scoped}:{cache_salt}"


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    buf = array("I", token_ids)
    if _BIG_ENDIAN:
        buf.byteswap()
    return buf.tobytes()


@dataclass(frozen=True)
class MultiModalSpan:
    """One multimodal item of a prompt: its content hash and the token range
    [offset, offset + length) its placeholder tokens occupy."""

    mm_hash: str
    offset: int
    length: int


def _tag(tag: bytes, value: bytes) -> bytes:
    # tag (1 byte) + length (4 bytes) + value: unambiguous concatenation.
    return tag + struct.pack("<I", len(value)) + value


def extra_keys(
    block_index: int,
    block_size: int,
    *,
    adapter_id: str | None = None,
    cache_salt: str | None = None,
    mm_spans: Sequence[MultiModalSpan] = (),
) -> bytes:
    """The extra-key bytes of block `block_index` (b"" when there are none)."""
    parts = []
    if adapter_id is not None:
        parts.append(_tag(b"A", adapter_id.encode()))
    if cache_salt is not None and block_index == 0:
        parts.append(_tag(b"S", cache_salt.encode()))
    if mm_spans:
        start, end = block_index * block_size, (block_index + 1) * block_size
        for span in mm_spans:
            if span.offset < end and span.offset + span.length > start:
                parts.append(_tag(b"M", f"{span.mm_hash}@{span.offset}".encode()))
    return b"".join(parts)


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """H(parent, token_ids, extra) for one full block."""
    return _sha256(parent + _tokens_bytes(token_ids) + extra).digest()


class BlockHasher:
    """Computes a request's chain of full-block hashes, incrementally.

    One instance per (block_size, seed); stateless otherwise, so one instance is
    shared by every request of an engine and by routers.
    """

    __slots__ = ("block_size", "root")

    def __init__(self, block_size: int, seed: str = DEFAULT_HASH_SEED) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.root = root_hash(seed)

    def extend(
        self,
        hashes: list[BlockHash],
        token_ids: Sequence[int],
        *,
        adapter_id: str | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> list[BlockHash]:
        """Append to `hashes` (mutated in place) the hashes of the full blocks of
        `token_ids` that it does not cover yet; returns the new hashes only.

        `token_ids` is the whole token sequence (prompt + output so far).
        """
        bs = self.block_size
        start = len(hashes)
        end = len(token_ids) // bs
        if end <= start:
            return []
        parent = hashes[-1] if hashes else self.root
        raw = _tokens_bytes(token_ids[start * bs : end * bs])
        width = bs * 4
        plain = adapter_id is None and not mm_spans
        new: list[BlockHash] = []
        for i in range(start, end):
            chunk = raw[(i - start) * width : (i - start + 1) * width]
            if plain and (cache_salt is None or i > 0):
                parent = _sha256(parent + chunk).digest()
            else:
                extra = extra_keys(
                    i, bs, adapter_id=adapter_id, cache_salt=cache_salt, mm_spans=mm_spans
                )
                parent = _sha256(parent + chunk + extra).digest()
            new.append(parent)
        hashes.extend(new)
        return new

    def chain(
        self,
        token_ids: Sequence[int],
        *,
        adapter_id: str | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
    ) -> list[BlockHash]:
        """The full chain of `token_ids` (what a router computes for a prompt)."""
        out: list[BlockHash] = []
        self.extend(out, token_ids, adapter_id=adapter_id, cache_salt=cache_salt, mm_spans=mm_spans)
        return out
