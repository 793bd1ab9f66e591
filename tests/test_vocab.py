"""Direct vocabulary mapping between real tokenizers, and byte-exact drafter context sync."""

from __future__ import annotations

from omnidraft.drafting.direct_map import Retokenizer, build_bridge, token_bytes_table, tokenizer_kind
from omnidraft.drafting.model_drafters import DirectMapDrafter


def _id(tok, piece):
    return tok.convert_tokens_to_ids(piece)


def test_kinds(llama2_tok, qwen_tiny, llama3_tiny):
    assert tokenizer_kind(llama2_tok) == "sentencepiece"
    assert tokenizer_kind(qwen_tiny[1]) == "byte_level"
    assert tokenizer_kind(llama3_tiny[1]) == "byte_level"


def test_llama2_to_qwen2_direct_map(llama2_tok, qwen_tiny, cache_dir):
    qtok = qwen_tiny[1]
    b = build_bridge(llama2_tok, qtok, cache_dir)
    # space marker and byte fallback normalised
    assert b.to_target(_id(llama2_tok, "▁the")) == _id(qtok, "Ġthe")
    assert b.to_target(_id(llama2_tok, "<0x0A>")) == _id(qtok, "Ċ")
    assert b.to_target(_id(llama2_tok, "▁st")) == _id(qtok, "Ġst")
    assert b.to_target(_id(llama2_tok, "amps")) == _id(qtok, "amps")
    # ' stamps' is ('▁st', 'amps') for Llama-2 and one token for Qwen2: the n-gram case
    assert llama2_tok.convert_ids_to_tokens(llama2_tok.encode(" stamps", add_special_tokens=False))[-2:] == ["▁st", "amps"]
    assert len(qtok.encode(" stamps", add_special_tokens=False)) == 1
    # Llama-2's <s> is special: it must not map to the literal text "<s>"
    assert b.to_target(llama2_tok.bos_token_id) == -1
    # overlap: SOURCES.md reports 22,286 identical strings; byte normalisation adds byte pieces
    # and other spellings of the same bytes
    assert 22_000 <= b.n_mapped <= 30_000
    assert b.n_target_covered <= b.n_mapped


def test_bridge_is_cached_on_disk(llama2_tok, qwen_tiny, tmp_path):
    b1 = build_bridge(llama2_tok, qwen_tiny[1], tmp_path)
    files = list((tmp_path / "vocab_maps").glob("*.safetensors"))
    assert len(files) == 1 and b1.key in files[0].name
    b2 = build_bridge(llama2_tok, qwen_tiny[1], tmp_path)
    assert (b1.d2t == b2.d2t).all()


def test_identity_bridge_maps_everything(qwen_tiny):
    tok = qwen_tiny[1]
    b = build_bridge(tok, tok)
    table, specials = token_bytes_table(tok)
    ids = [i for i, x in enumerate(table) if x is not None]
    assert all(b.to_target(i) == i for i in ids[:: 97])
    for i in specials:  # special tokens map to themselves by content
        assert b.to_target(i) == i


def test_retokenizer_drops_sentencepiece_dummy_prefix(llama2_tok):
    table, _ = token_bytes_table(llama2_tok)
    inv = {}
    for i, x in enumerate(table):
        if x is not None:
            inv.setdefault(x, i)
    rt = Retokenizer(llama2_tok, table, inv)
    for text in ["Hello", " Hello", "\nfoo bar", "ünï", "42"]:
        assert rt.spelled(rt.encode(text)) == text.encode()


def test_drafter_context_tracks_target_text(pair_llama2_qwen):
    """Commits of target tokens (split UTF-8 included) keep the drafter's context byte-exact."""
    target, ttok, drafter, dtok, bridge = pair_llama2_qwen
    d = DirectMapDrafter(drafter, dtok, bridge, target.config.vocab_size, sync_lookbehind=2)
    prompt = ttok.encode("Question: what is 2+2?")
    d.start(prompt)
    n_prompt = d.n_prompt
    text = " The answer — 4 🚀 naïve stamps\n  indented"
    ids = ttok.encode(text, add_special_tokens=False)
    for i in range(0, len(ids), 2):
        d.commit(ids[i: i + 2], 0)
    assert d.retok.spelled(d.ids[n_prompt:]) == text.encode()
    assert d.ids[:n_prompt] == dtok.encode(ttok.decode(prompt))


def test_an_spm_target_gets_the_piece_it_emits_not_its_byte_fallback(llama2_tok, qwen_tiny):
    """Byte-level drafter -> SentencePiece target: '.' spells the same byte as the target's '<0x2E>'
    fallback piece (a lower id), but the target's tokenizer emits its '.' piece: the map must take it
    (else no drafted '.', digit or letter is ever accepted); a byte no piece covers keeps its fallback."""
    qtok = qwen_tiny[1]
    b = build_bridge(qtok, llama2_tok)
    for text in (".", "1", "A", ","):
        piece, fallback = _id(llama2_tok, text), _id(llama2_tok, f"<0x{ord(text):02X}>")
        assert fallback < piece  # the lowest id spelling these bytes is the fallback
        assert llama2_tok.encode("a" + text, add_special_tokens=False)[-1] == piece  # what the target emits
        assert b.to_target(_id(qtok, text)) == piece, text
    assert b.to_target(_id(qtok, "Ċ")) == _id(llama2_tok, "<0x0A>")  # '\n' has no piece: the fallback
    # and the other way round, the drafter side's byte -> id table prefers the emitted piece too
    assert build_bridge(llama2_tok, qtok).draft_bytes_to_id[b"."] == _id(llama2_tok, ".")


def test_an_added_token_that_is_plain_text_maps_by_its_content(qwen_tiny, llama2_tok):
    """Gemma 3 keeps '\\n' and '\\n\\n' as added tokens marked not special: they are text, so a
    drafter's newline tokens map to them; an added token marked special still maps by content only."""
    import copy

    from tokenizers import AddedToken

    target = copy.deepcopy(llama2_tok)
    target.add_tokens([AddedToken("\n\n", special=False, normalized=False)])
    target.add_tokens([AddedToken("<|mark|>", special=True)])
    nn = target.convert_tokens_to_ids("\n\n")
    table, specials = token_bytes_table(target)
    assert table[nn] == b"\n\n" and nn in specials  # counted as added, as tokenizer_hash always has
    b = build_bridge(qwen_tiny[1], target)
    assert b.to_target(_id(qwen_tiny[1], "ĊĊ")) == nn
    assert target.convert_tokens_to_ids("<|mark|>") not in b.d2t.tolist()
