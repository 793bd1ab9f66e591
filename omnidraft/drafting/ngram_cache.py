"""The online n-gram cache: ONE target token <-> the SEQUENCE of drafter tokens that spells it.

Example: a Llama-2-tokenizer drafter spells Qwen2's ' stamps' as ('▁st', 'amps'). Entries are
learnt online from accepted target text (see :func:`alignments`), and used when drafting: the
drafter's k proposals are scanned left to right, and a run of drafter tokens equal to an entry is
merged into its one target token (longest match first), giving m <= k target proposals.

A drafter token that is neither directly mapped nor the start of a cache hit ends the proposal
there (project choice; the paper is silent). Optional capacity with LRU or LFU eviction.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from omnidraft.core.feedback import Span


@dataclass
class NgramCache:
    """Map drafter-token sequences (length >= 2) to target tokens, with optional eviction.

    Args:
        capacity: maximum number of entries (None = unbounded, the paper's main setting).
        eviction: 'lru' or 'lfu' when a capacity is set.
    """

    capacity: int | None = None
    eviction: str = "lru"
    _by_seq: "OrderedDict[tuple[int, ...], int]" = field(default_factory=OrderedDict)
    _by_target: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _uses: dict[tuple[int, ...], int] = field(default_factory=dict)
    _max_len: int = 0
    lookups: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {self.capacity}")

    def __len__(self) -> int:
        return len(self._by_seq)

    def __contains__(self, seq: Sequence[int]) -> bool:
        return tuple(seq) in self._by_seq

    def get(self, seq: Sequence[int]) -> int | None:
        return self._by_seq.get(tuple(seq))

    def spelling(self, target_id: int) -> tuple[int, ...] | None:
        return self._by_target.get(target_id)

    def add(self, target_id: int, draft_seq: Sequence[int]) -> bool:
        """Add an entry; returns False if the sequence is too short or already known."""
        seq = tuple(int(x) for x in draft_seq)
        if len(seq) < 2 or seq in self._by_seq or target_id in self._by_target:
            return False
        if self.capacity is not None and len(self._by_seq) >= self.capacity:
            self._evict()
        self._by_seq[seq] = int(target_id)
        self._by_target[int(target_id)] = seq
        self._uses[seq] = 0
        self._max_len = max(self._max_len, len(seq))
        return True

    def _evict(self) -> None:
        if self.eviction == "lru":
            seq = next(iter(self._by_seq))  # least recently used first
        else:  # least frequently used; ties: oldest
            seq = min(self._by_seq, key=lambda s: self._uses[s])
        t = self._by_seq.pop(seq)
        del self._by_target[t]
        del self._uses[seq]

    def _touch(self, seq: tuple[int, ...]) -> None:
        self._by_seq.move_to_end(seq)
        self._uses[seq] += 1

    def merge(self, draft: Sequence[int], direct: Callable[[int], int]) -> list[Span]:
        """Translate drafter tokens into target proposals.

        Args:
            draft: k drafter token ids, in order.
            direct: drafter id -> target id, or -1 when it has no direct match.
        Returns:
            merged proposals covering a prefix of ``draft``; scanning stops at the first drafter
            token that is neither a cache hit's start nor directly mapped.
        """
        out: list[Span] = []
        i, k = 0, len(draft)
        while i < k:
            hit = None
            for n in range(min(self._max_len, k - i), 1, -1):  # longest match first
                self.lookups += 1
                seq = tuple(draft[i: i + n])
                t = self._by_seq.get(seq)
                if t is not None:
                    hit = (t, n, seq)
                    break
            if hit is not None:
                t, n, seq = hit
                self.hits += 1
                self._touch(seq)
                out.append(Span(t, i, i + n))
                i += n
                continue
            t = direct(draft[i])
            if t < 0:
                break
            out.append(Span(t, i, i + 1))
            i += 1
        return out

    def nbytes(self) -> int:
        """Approximate payload size: 4 bytes per stored id."""
        return sum(4 * (len(s) + 1) for s in self._by_seq)

    def stats(self) -> dict[str, float]:
        return {"ngram/size": len(self), "ngram/bytes": self.nbytes(), "ngram/lookups": self.lookups,
                "ngram/hits": self.hits}

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "eviction": self.eviction,
                "entries": [[list(s), t, self._uses[s]] for s, t in self._by_seq.items()],
                "lookups": self.lookups, "hits": self.hits}

    @classmethod
    def from_state_dict(cls, d: dict) -> "NgramCache":
        c = cls(capacity=d["capacity"], eviction=d["eviction"])
        for seq, t, uses in d["entries"]:
            c.add(t, seq)
            c._uses[tuple(seq)] = uses
        c.lookups, c.hits = d["lookups"], d["hits"]
        return c

    def to_json(self) -> str:
        return json.dumps(self.state_dict())


def alignments(target_ids: Sequence[int], target_bytes: Sequence[bytes | None],
               draft_ids: Sequence[int], draft_bytes: Sequence[bytes | None],
               target_offset: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """Target tokens whose bytes are spelled exactly by a run of >= 2 drafter tokens.

    Both sequences spell the same text (the drafter's in-context re-tokenisation of the accepted
    target text). A target token qualifies when its byte span starts and ends on drafter-token
    boundaries and covers more than one drafter token. ``target_offset``: byte offset in the
    drafter text where the target tokens start (e.g. after re-tokenised look-behind tokens).

    Returns:
        (target_id, drafter-id tuple) pairs, in text order.
    """
    starts: dict[int, int] = {}  # byte offset -> index of the drafter token starting there
    d_ends: dict[int, int] = {}  # byte offset -> 1 + index of the drafter token ending there
    pos = 0
    for j, d in enumerate(draft_ids):
        starts[pos] = j
        pos += len(draft_bytes[d] or b"")
        d_ends[pos] = j + 1
    out = []
    pos = target_offset
    for t in target_ids:
        b = target_bytes[t]
        if b is None:
            break
        a, e = pos, pos + len(b)
        pos = e
        if a in starts and e in d_ends:
            j0, j1 = starts[a], d_ends[e]
            seq = tuple(int(x) for x in draft_ids[j0:j1])
            if len(seq) >= 2 and b"".join(draft_bytes[d] or b"" for d in seq) == b:
                out.append((int(t), seq))
    return out
