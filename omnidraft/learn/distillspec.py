"""DistillSpec's offline distillation data, cross-vocabulary (no Hydra; the runner drives it).

For each training prompt a response is generated, either by the target (``data='target'``: the
teacher's own greedy/sampled text) or by the drafter itself (``data='drafter'``: on-policy, the
student's text). One target forward over prompt + response scores every response token. The
response is tokenised on both sides and aligned byte for byte: a drafter token that spells exactly
one target token at the same offset, and maps to it through the direct map, is a training position
whose teacher distribution is that target row (renormalised over the target tokens the drafter can
reach). Positions where the tokenisations disagree are skipped. Each prompt becomes one
:class:`omnidraft.learn.buffer.Example` (context = drafter prompt, drafts = drafter response), trained
by :class:`omnidraft.learn.online.OnlineLearner` with a divergence loss (fkl, rkl, jsd, tvd).
"""

from __future__ import annotations

import torch

from omnidraft.choices import DISTILL_DATA
from omnidraft.core import kv
from omnidraft.core.decode import generate
from omnidraft.drafting.direct_map import Retokenizer, VocabBridge
from omnidraft.learn.buffer import Example


def aligned_positions(t_ids: list[int], d_ids: list[int], bridge: VocabBridge) -> list[tuple[int, int]]:
    """(drafter index j, target index i) pairs where drafter token j and target token i cover the
    same bytes of the same text and d_ids[j] maps directly to t_ids[i]. Empty if the two token
    sequences do not spell the same bytes."""
    tb, db = bridge.target_bytes, bridge.draft_bytes
    t_span, d_span, a = {}, [], 0
    for i, t in enumerate(t_ids):
        n = len(tb[t] or b"")
        t_span[a] = (i, a + n)
        a += n
    b = 0
    for d in d_ids:
        n = len(db[d] or b"")
        d_span.append((b, b + n))
        b += n
    if a != b or bridge.target_text_bytes(t_ids) != b"".join(db[d] or b"" for d in d_ids):
        return []
    out = []
    for j, (s, e) in enumerate(d_span):
        hit = t_span.get(s)
        if hit is not None and hit[1] == e and e > s and bridge.to_target(d_ids[j]) == t_ids[hit[0]]:
            out.append((j, hit[0]))
    return out


def _complete_utf8(ids: list[int], spell) -> list[int]:
    """Drop trailing tokens until the text is complete UTF-8 (a response cut mid-character)."""
    while ids:
        try:
            spell(ids).decode("utf-8")
            return ids
        except UnicodeDecodeError:
            ids = ids[:-1]
    return ids


@torch.no_grad()
def make_example(seq: int, target, target_tok, draft_model, draft_tok, bridge: VocabBridge, cols: torch.Tensor,
                 prompt_ids: list[int], *, data: str = "drafter", max_new_tokens: int = 128,
                 eos_ids: set[int] = frozenset(), draft_eos: set[int] = frozenset(),
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> tuple[Example | None, dict]:
    """One training example from one prompt (target ids, chat template applied).

    Returns:
        (example or None when no position aligns, stats: response tokens and aligned positions).
    """
    if data not in DISTILL_DATA:
        raise ValueError(f"data must be one of {DISTILL_DATA}, got {data!r}")
    text = bridge.target_text_bytes(prompt_ids).decode("utf-8", errors="replace")
    d_prompt = draft_tok.encode(text, add_special_tokens=True)
    retok = Retokenizer(draft_tok, bridge.draft_bytes, bridge.draft_bytes_to_id)
    if data == "target":
        r_t = generate(target, prompt_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                       temperature=temperature, generator=generator).tokens
        r_t = _complete_utf8([t for t in r_t if t not in eos_ids], bridge.target_text_bytes)
        r_text = bridge.target_text_bytes(r_t).decode("utf-8")
    else:
        r_d = generate(draft_model, d_prompt, max_new_tokens=max_new_tokens, eos_ids=draft_eos,
                       temperature=temperature, generator=generator).tokens
        r_d = _complete_utf8([d for d in r_d if d not in draft_eos], retok.spelled)
        r_text = retok.spelled(r_d).decode("utf-8")
        r_t = target_tok.encode(r_text, add_special_tokens=False)
    r_d = retok.encode(r_text)
    pairs = aligned_positions(r_t, r_d, bridge)
    stats = {"distill/response_tokens": len(r_t), "distill/aligned": len(pairs)}
    if not pairs or not r_t:
        return None, stats
    cache = kv.new_cache(target)
    full = prompt_ids + r_t
    logits = kv.forward(target, full[:-1], cache, keep=len(r_t))  # row i predicts r_t[i]
    logp = torch.log_softmax(logits.float(), -1)
    rows = torch.tensor([i for _, i in pairs])
    c = cols.to(logp.device)
    dm_logp = logp[rows][:, c]
    top = logp[rows].argmax(-1)
    col = torch.searchsorted(c, top).clamp(max=len(c) - 1)
    dm_top = torch.where(c[col] == top, col, -1).tolist()
    ex = Example(seq, d_prompt, r_d, [j for j, _ in pairs], dm_logp.to(torch.float16).cpu(), dm_top, [])
    return ex, stats

