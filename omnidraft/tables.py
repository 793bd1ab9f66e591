"""Per-prompt rows and the run summary. One token counting for every method: new target tokens
emitted (EOS included), over wall seconds of the whole generation (prefill included)."""

from __future__ import annotations

from typing import Any

from omnidraft.core.decode import GenerationResult


def prompt_row(sd: GenerationResult, ar: GenerationResult | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "sd/new_tokens": sd.n_new, "sd/wall_s": sd.wall_s, "sd/steps": len(sd.steps),
        "sd/proposed": sd.proposed, "sd/accepted": sd.accepted, "sd/draft_s": sd.draft_s,
        "sd/target_s": sd.target_s, "sd/prefill_s": sd.prefill_s, "sd/stop": sd.stop,
        "accept/rate": sd.accepted / sd.proposed if sd.proposed else 0.0,
        "accept/mean_len": sd.n_new / max(1, len(sd.steps)),
        "speed/sd_tok_per_s": sd.n_new / sd.wall_s if sd.wall_s else 0.0,
        # per verification step: target proposals (the draft length in target tokens) and accepted
        "sd/step_proposed": [st.proposed for st in sd.steps],
        "sd/step_accepted": [st.accepted for st in sd.steps],
    }
    if ar is not None:
        row.update({
            "ar/new_tokens": ar.n_new, "ar/wall_s": ar.wall_s, "ar/steps": len(ar.steps),
            "ar/target_s": ar.target_s, "ar/prefill_s": ar.prefill_s,
            "speed/ar_tok_per_s": ar.n_new / ar.wall_s if ar.wall_s else 0.0,
            "speed/speedup": (sd.n_new / sd.wall_s) / (ar.n_new / ar.wall_s) if ar.n_new and sd.wall_s else 0.0,
            "lossless/match": sd.tokens == ar.tokens,
            "lossless/first_mismatch": _first_mismatch(sd.tokens, ar.tokens),
        })
    return row


def drafter_row(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Per-prompt drafter statistics from cumulative counters (n-gram cache size, hits per step)."""
    row: dict[str, float] = {}
    if "draft/tokens" in after:
        row["draft/mean_len"] = (after["draft/tokens"] - before.get("draft/tokens", 0)) / max(1, steps)
    if "ngram/size" in after:
        row["ngram/size"] = after["ngram/size"]
        row["ngram/bytes"] = after["ngram/bytes"]
        row["ngram/hits"] = after["ngram/proposed_hits"] - before.get("ngram/proposed_hits", 0)
        row["ngram/hits_per_step"] = row["ngram/hits"] / max(1, steps)
    return row


def _first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def _rate(rs: list[dict[str, Any]]) -> float:
    p = sum(r["sd/proposed"] for r in rs)
    return sum(r["sd/accepted"] for r in rs) / p if p else 0.0


def summarise(rows: list[dict[str, Any]], greedy: bool, window: int = 50) -> dict[str, Any]:
    """Aggregate per-prompt rows: totals first, ratios of totals (not means of ratios)."""
    s: dict[str, Any] = {"n_prompts": len(rows)}
    if not rows:
        return s
    tot = lambda k, rs=rows: sum(r.get(k, 0) for r in rs)  # noqa: E731
    proposed, steps = tot("sd/proposed"), tot("sd/steps")
    s["accept/rate"] = _rate(rows)
    s["accept/mean_len"] = tot("sd/new_tokens") / steps if steps else 0.0
    s["accept/proposed_per_step"] = proposed / steps if steps else 0.0
    s["speed/sd_tok_per_s_all"] = tot("sd/new_tokens") / tot("sd/wall_s")
    s["time/draft_share"] = tot("sd/draft_s") / tot("sd/wall_s")
    s["time/target_share"] = tot("sd/target_s") / tot("sd/wall_s")
    w = max(1, min(window, len(rows) // 2))  # short runs: two halves, never overlapping windows
    s["accept/window"] = w
    s["accept/rate_first_window"] = _rate(rows[:w])
    s["accept/rate_last_window"] = _rate(rows[-w:])
    if any("adapt/update_s" in r for r in rows):
        up = tot("adapt/update_s")
        s["adapt/time_share"] = up / (up + tot("sd/wall_s") + tot("ar/wall_s"))
        s["adapt/n_updates"] = sum("adapt/update_s" in r for r in rows)
    dr = [r for r in rows if "draft/mean_len" in r]  # rows logged by code that counted drafted tokens
    if dr:
        dsteps = sum(r["sd/steps"] for r in dr)
        s["draft/mean_len"] = sum(r["draft/mean_len"] * r["sd/steps"] for r in dr) / dsteps if dsteps else 0.0
    if any("head/pred_accept" in r for r in rows):
        hr = [r for r in rows if "head/pred_accept" in r]
        n = sum(r["head/n"] for r in hr)
        s["head/pred_accept"] = sum(r["head/pred_accept"] * r["head/n"] for r in hr) / n
        s["head/obs_accept"] = sum(r["head/obs_accept"] * r["head/n"] for r in hr) / n
        dr = [r for r in hr if "head/pred_accept_debiased" in r]
        if dr:
            s["head/pred_accept_debiased"] = sum(r["head/pred_accept_debiased"] * r["head/n"] for r in dr) / \
                sum(r["head/n"] for r in dr)
    if "ngram/size" in rows[-1]:
        s["ngram/size"] = rows[-1]["ngram/size"]
        s["ngram/bytes"] = rows[-1]["ngram/bytes"]
        s["ngram/hits_per_step"] = tot("ngram/hits") / steps if steps else 0.0
    paired = [r for r in rows if "ar/new_tokens" in r]
    s["n_baseline_prompts"] = len(paired)
    if paired:
        sd_tps = tot("sd/new_tokens", paired) / tot("sd/wall_s", paired)
        ar_tps = tot("ar/new_tokens", paired) / tot("ar/wall_s", paired)
        s["speed/sd_tok_per_s"] = sd_tps
        s["speed/ar_tok_per_s"] = ar_tps
        s["speed/speedup"] = sd_tps / ar_tps
        # Paper / Medusa convention: tokens per step / (SD step latency / plain step latency).
        sd_step = (tot("sd/draft_s", paired) + tot("sd/target_s", paired)) / tot("sd/steps", paired)
        ar_step = tot("ar/target_s", paired) / tot("ar/steps", paired)
        s["speed/sd_step_s"] = sd_step
        s["speed/ar_step_s"] = ar_step
        s["speed/modelled_speedup"] = (tot("sd/new_tokens", paired) / tot("sd/steps", paired)) / (sd_step / ar_step)
        if greedy:
            s["lossless/match_rate"] = sum(bool(r["lossless/match"]) for r in paired) / len(paired)
    return s
