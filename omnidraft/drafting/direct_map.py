"""Direct vocabulary mapping between two tokenizers, and byte-exact text sync helpers.

Every token is reduced to the bytes it spells: byte-level BPE strings go through the GPT-2
byte<->unicode table ('Ġ' -> b' ', 'Ċ' -> b'\\n'); SentencePiece strings replace '▁' by a space and
read byte-fallback pieces ('<0x0A>') as the byte they name. Two tokens map directly when their
bytes are equal. Special tokens never map by bytes; they map to the other tokenizer's special or
added token with identical content (e.g. ChatML's '<|im_end|>' on both sides).
The map is computed once per tokenizer pair and cached on disk, keyed by both tokenizers' content
hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# v2: equal bytes map to a regular piece before a byte-fallback piece (v1 took the lowest id, so
# SentencePiece targets got '<0x2E>' for '.', which they never emit)
# and added tokens that are plain text (special=False: Gemma's '\n') map by their content's bytes
_MAP_FORMAT = "v2"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _once(tok, name: str, fn: Callable[[Any], Any]) -> Any:
    """``fn(tok)``, computed once per tokenizer object and vocabulary: a run asks for the same
    tokenizer's vocabulary, kind, byte table and hash many times (a 150k vocabulary costs seconds
    each). A tokenizer given tokens since (``add_tokens``) is analysed again. Callers must not
    mutate what this returns."""
    key = (name, len(tok), len(getattr(tok, "added_tokens_decoder", {}) or {}))
    try:
        slot = _FACTS.setdefault(tok, {})
    except TypeError:  # not weak-referenceable or unhashable: no memo
        return fn(tok)
    if key not in slot:
        slot[key] = fn(tok)
    return slot[key]


def _vocab(tok) -> dict[str, int]:
    return _once(tok, "vocab", lambda t: t.get_vocab())


def _special_ids(tok) -> dict[int, str]:
    """id -> content for special and added tokens."""
    out = {int(i): str(t) for i, t in zip(tok.all_special_ids, tok.all_special_tokens)}
    for i, at in getattr(tok, "added_tokens_decoder", {}).items():
        out[int(i)] = at.content if hasattr(at, "content") else str(at)
    return out


def tokenizer_kind(tok) -> str:
    """'byte_level' (GPT-2 style 'Ġ') or 'sentencepiece' ('▁', '<0xNN>' byte fallback)."""
    return _once(tok, "kind", _tokenizer_kind)


def _tokenizer_kind(tok) -> str:
    vocab = _vocab(tok)
    n_g = sum(1 for s in vocab if s.startswith("Ġ"))
    n_sp = sum(1 for s in vocab if s.startswith("▁"))
    return "byte_level" if n_g > n_sp else "sentencepiece"


def token_bytes_table(tok) -> tuple[list[bytes | None], dict[int, str]]:
    """Bytes spelled by each token id (None for special tokens and added tokens marked special;
    an added token marked not special is plain text and spells its content), and the specials
    (every added token, as :func:`tokenizer_hash` has always counted them).

    Returns:
        table: list of length ``len(tok)``; ``table[i]`` is the byte string of token i.
        specials: id -> content for special/added tokens.

    Computed once per tokenizer object (shared: do not mutate).
    """
    return _once(tok, "bytes_table", _token_bytes_table)


def _token_bytes_table(tok) -> tuple[list[bytes | None], dict[int, str]]:
    specials = _special_ids(tok)
    kind = tokenizer_kind(tok)
    dec = _byte_decoder()
    vocab = _vocab(tok)
    n = max(len(tok), max(vocab.values()) + 1)
    table: list[bytes | None] = [None] * n
    text_added = {int(i): at.content for i, at in getattr(tok, "added_tokens_decoder", {}).items()
                  if not getattr(at, "special", True) and getattr(at, "content", None)}
    for s, i in vocab.items():
        if i in text_added:  # an added token that is plain text (Gemma's '\n', '\n\n'): its content's bytes
            table[i] = text_added[i].encode("utf-8")
            continue
        if i in specials:
            continue
        if kind == "byte_level":
            try:
                table[i] = bytes(dec[c] for c in s)
            except KeyError:
                table[i] = s.encode("utf-8")
        else:
            m = _BYTE_PIECE.match(s)
            table[i] = bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode("utf-8")
    return table, specials


def byte_piece_ids(tok) -> frozenset[int]:
    """Ids of SentencePiece byte-fallback pieces ('<0x2E>'): they spell one byte that a regular piece
    often spells too ('.'), and the tokenizer emits them only for bytes no piece covers."""
    if tokenizer_kind(tok) == "byte_level":
        return frozenset()
    return _once(tok, "byte_pieces", lambda t: frozenset(i for s, i in _vocab(t).items() if _BYTE_PIECE.match(s)))


def _preferred(table: list[bytes | None], byte_pieces: frozenset[int]) -> dict[bytes, int]:
    """bytes -> the id a tokenizer itself emits for them: a regular piece over a byte-fallback piece,
    then the lowest id."""
    out: dict[bytes, int] = {}
    for i, b in enumerate(table):
        if b is None:
            continue
        j = out.get(b)
        if j is None or (j in byte_pieces and i not in byte_pieces):
            out[b] = i
    return out


def tokenizer_hash(tok) -> str:
    """Content hash of a tokenizer's vocabulary and special tokens (once per tokenizer object)."""
    return _once(tok, "hash", _tokenizer_hash)


def _tokenizer_hash(tok) -> str:
    h = hashlib.sha256()
    h.update(type(tok).__name__.encode())
    h.update(json.dumps(sorted(_vocab(tok).items()), ensure_ascii=False).encode())
    h.update(json.dumps(sorted(_special_ids(tok).items())).encode())
    return h.hexdigest()


@dataclass
class VocabBridge:
    """Direct map from drafter ids to target ids.

    Attributes:
        d2t: (V_d,) long; target id of each drafter token, -1 where it has no direct match.
        draft_bytes / target_bytes: bytes spelled by each token (None for specials).
        n_mapped: number of drafter tokens with a direct match.
        n_target_covered: number of distinct target tokens reached.
    """

    d2t: torch.Tensor
    draft_bytes: list[bytes | None]
    target_bytes: list[bytes | None]
    draft_specials: dict[int, str]
    target_specials: dict[int, str]
    key: str
    draft_byte_pieces: frozenset[int] = frozenset()
    draft_mask: torch.Tensor = field(init=False)
    n_mapped: int = field(init=False)
    n_target_covered: int = field(init=False)

    def __post_init__(self) -> None:
        self.draft_mask = self.d2t >= 0
        self.n_mapped = int(self.draft_mask.sum())
        self.n_target_covered = int(torch.unique(self.d2t[self.draft_mask]).numel())
        self._draft_bytes_to_id: dict[bytes, int] | None = None
        self._d2t_list = self.d2t.tolist()

    def to_target(self, draft_id: int) -> int:
        return self._d2t_list[draft_id]

    @property
    def draft_bytes_to_id(self) -> dict[bytes, int]:
        if self._draft_bytes_to_id is None:
            self._draft_bytes_to_id = _preferred(self.draft_bytes, self.draft_byte_pieces)
        return self._draft_bytes_to_id

    def target_text_bytes(self, ids: list[int]) -> bytes:
        """Bytes of target tokens; special tokens contribute their content."""
        tb, sp = self.target_bytes, self.target_specials
        return b"".join(tb[i] if tb[i] is not None else sp.get(i, "").encode() for i in ids)

    def stats(self) -> dict:
        return {"vocab/n_mapped": self.n_mapped, "vocab/n_target_covered": self.n_target_covered,
                "vocab/draft_size": int(self.d2t.numel()), "vocab/target_size": len(self.target_bytes),
                "vocab/draft_coverage": self.n_mapped / max(1, self.d2t.numel())}


def _build_d2t(draft_bytes, draft_specials, target_bytes, target_specials,
               target_byte_pieces: frozenset[int] = frozenset()) -> torch.Tensor:
    # For equal bytes, the token the target's own tokenizer would emit: a regular piece over a
    # byte-fallback piece ('.' over '<0x2E>'), then the lowest id.
    by_bytes = _preferred(target_bytes, target_byte_pieces)
    special_by_content = {c: i for i, c in target_specials.items()}
    d2t = torch.full((len(draft_bytes),), -1, dtype=torch.long)
    for i, b in enumerate(draft_bytes):
        if b is not None:
            j = by_bytes.get(b)
            if j is not None:
                d2t[i] = j
    for i, c in draft_specials.items():
        j = special_by_content.get(c)
        if j is not None and i < len(d2t):
            d2t[i] = j
    return d2t


def build_bridge(draft_tok, target_tok, cache_dir: Path | None = None) -> VocabBridge:
    """Direct map between two tokenizers; cached on disk under ``cache_dir/vocab_maps``."""
    db, ds = token_bytes_table(draft_tok)
    tb, ts = token_bytes_table(target_tok)
    key = f"{tokenizer_hash(draft_tok)[:16]}_{tokenizer_hash(target_tok)[:16]}"
    # the map's format in the file name: maps built by earlier rules are not reused
    path = Path(cache_dir) / "vocab_maps" / f"{key}.{_MAP_FORMAT}.safetensors" if cache_dir else None
    if path is not None and path.exists():
        d2t = load_file(path)["d2t"]
    else:
        d2t = _build_d2t(db, ds, tb, ts, byte_piece_ids(target_tok))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per writer: processes share the cache
            save_file({"d2t": d2t.contiguous()}, str(tmp), metadata={"key": key})
            os.replace(tmp, path)
    return VocabBridge(d2t, db, tb, ds, ts, key, byte_piece_ids(draft_tok))


class Retokenizer:
    """Encode text for a drafter so that the tokens spell exactly the given bytes.

    SentencePiece tokenizers prepend a dummy '▁' to every encoded string; re-tokenising a suffix
    must not add that space. Used to bring the drafter's context in sync with accepted target text.
    """

    def __init__(self, tok, token_bytes: list[bytes | None], bytes_to_id: dict[bytes, int]):
        self.tok = tok
        self.token_bytes = token_bytes
        self.bytes_to_id = bytes_to_id

    def spelled(self, ids: list[int]) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in ids)

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        want = text.encode("utf-8")
        got = self.spelled(ids)
        if got == want or not ids:
            return ids
        if got == b" " + want:  # dummy prefix added
            first = self.token_bytes[ids[0]] or b""
            if first == b" ":
                return ids[1:]
            fix = self.bytes_to_id.get(first[1:])
            if first.startswith(b" ") and fix is not None:
                return [fix] + ids[1:]
        return ids
