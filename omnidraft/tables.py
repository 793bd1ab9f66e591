"""Result rows, their aggregation, the Markdown tables and the readers of result files.

The one place that says what a result row holds. The stream runner (``omnidraft``) and the bench
(``omnidraft bench``) build their rows here, aggregate them with :func:`summarise`, and
``omnidraft tables <group>`` renders ``results/<group>/table.md`` from the files they wrote
(tables are generated from result files, never typed).

Row schema
----------
One row per generation: one prompt (one turn of a multi-turn prompt) decoded by one method. The
stream runner writes one per prompt turn to ``metrics.jsonl``, the bench one per prompt and
method. ``sd/`` is the method under test (whatever it is, ``ar`` included), ``ar/`` the plain
autoregressive decode of the same prompt, when it was measured. Tokens are counted one way for
every method: new target tokens (EOS included) over wall seconds of the whole generation
(prefill included).

===========================  =====================================================================
key                          meaning
===========================  =====================================================================
``prompt/id``                the task record's id
``prompt/index``             position in the stream (0-based)
``task``                     the task the prompt came from
``prompt/turn``              stream: the turn of a multi-turn record (0-based)
``prompt/tokens``            stream: prompt length in target tokens
``method``                   bench: the method (or variant) label
``sd/new_tokens``            new target tokens emitted
``sd/wall_s``                wall seconds of the generation
``sd/steps``                 verification steps (target forwards after the prefill)
``sd/proposed``              drafted tokens offered to the target (in target tokens)
``sd/accepted``              of those, accepted
``sd/draft_s``               seconds drafting (the decode loop's own split of ``sd/wall_s``)
``sd/target_s``              seconds verifying
``sd/prefill_s``             seconds of the prefill
``sd/stop``                  ``eos`` or ``length``
``sd/step_proposed``         per step: target tokens proposed (the draft length)
``sd/step_accepted``         per step: accepted
``sd/step_feeds``            per step: tokens each drafter forward fed (empty: no drafter model)
``sd/step_hidden``           per step, where any step's were: 1 if its drafter forwards also
                             returned hidden states (the acceptance head's); with ``sd/step_feeds``
                             and ``sd/step_proposed`` the step's shape, which a replay's speed is
                             modelled from (``omnidraft tables DIR --speed-machine``)
``sd/step_lookup``           per step, where any step was: 1 if prompt lookup proposed it, 0 if the
                             drafter LM did (summary: ``draft/<lookup|model>_accept_rate`` and
                             ``draft/<lookup|model>_tokens_per_step``, emitted tokens per step)
``sd/forward_s``             bench: seconds inside model forwards (None when not profiled)
``accept/rate``              the row's ``sd/accepted / sd/proposed``
``accept/mean_len``          the row's ``sd/new_tokens / sd/steps``
``speed/sd_tok_per_s``       the row's ``sd/new_tokens / sd/wall_s``
``ar/new_tokens``            (rows that measured ar) ar's new tokens
``ar/wall_s``                ar's wall seconds
``ar/steps``                 ar's steps (one per token)
``ar/target_s``              ar's seconds in the target
``ar/prefill_s``             ar's prefill seconds
``speed/ar_tok_per_s``       ar's tokens per second
``speed/speedup``            the row's tokens/s over ar's
``lossless/match``           the method emitted ar's tokens exactly
``lossless/near_tie``        where it did not (greedy, live): the first divergence is a numerical
                             near-tie, the top-2 logit gap there below one ulp of the dtype
                             (omnidraft.core.certify; ``lossless/gap_batched``, ``_stepwise``,
                             ``lossless/resolution``); summaries: ``lossless/near_tie_rate``,
                             ``lossless/unexplained`` (divergences that are not near-ties)
``speed/modelled_speedup``   engine=replay: the row's speedup modelled from this machine's latency
                             calibration (``speed/modelled_sd_s``: its steps' modelled seconds,
                             ``speed/modelled_ar_step_s``: one plain step's); wall times of a
                             replay are the drafter's, plus the target rows of its learners
``lossless/first_mismatch``  first differing position (-1: equal)
``draft/mean_len``           stream: drafter tokens per step (model drafters)
``ngram/size``               stream: n-gram cache entries after the prompt (``ngram/bytes`` its size)
``ngram/hits``               stream: proposals served by the cache (``ngram/hits_per_step``)
``draft/lookup_steps``       stream: steps proposed by prompt lookup instead of the drafter LM
                             (``draft/lookup_tokens`` their proposals; summary
                             ``draft/lookup_step_share``)
``head/*``                   acceptance head calibration since the last row (``head/n`` proposals)
``adapt/update_s``           only on prompts after which an online update ran: its seconds (with
                             the learner's ``adapt/*`` / ``head/*`` statistics)
``quality/*``                stream: the task's quality scores (``text/output``: the text)
``mem/rss_gib``              bench: process RSS after the generation
===========================  =====================================================================

Rows that benches wrote before this schema used unprefixed keys; :func:`normalise_row` maps them
(:data:`LEGACY_BENCH_KEYS`) when result files are read, so committed results read unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omnidraft.data.quality import summarise_quality
from omnidraft.errors import OmniDraftError

if TYPE_CHECKING:
    from omnidraft.core.decode import GenerationResult

# Bench rows before the shared schema -> schema keys. ``adapt_s`` was written on every row (0.0 when
# no update ran); in the schema ``adapt/update_s`` marks the rows that updated, so a 0.0 is dropped.
LEGACY_BENCH_KEYS = {
    "new_tokens": "sd/new_tokens", "wall_s": "sd/wall_s", "steps": "sd/steps", "proposed": "sd/proposed",
    "accepted": "sd/accepted", "forward_s": "sd/forward_s", "draft_s": "sd/draft_s", "target_s": "sd/target_s",
    "ar_new_tokens": "ar/new_tokens", "ar_wall_s": "ar/wall_s", "speedup": "speed/speedup",
    "match_ar": "lossless/match", "rss_gib": "mem/rss_gib", "adapt_s": "adapt/update_s",
}

# Per-method keys every bench result holds (results JSON ``methods`` / ``per_task``).
BENCH_KEYS = ("speed/speedup", "speed/speedup_mean_ratio", "speed/tok_per_s", "accept/rate", "accept/mean_len",
              "lossless/match_rate", "overhead/share", "mem/peak_rss_gib")


# ---------------------------------------------------------------------------------------- rows


def prompt_row(sd: GenerationResult, ar: GenerationResult | None) -> dict[str, Any]:
    """One generation's ``sd/*`` keys, and its ``ar/*`` comparison when ``ar`` ran.

    Args:
        sd: the method's generation.
        ar: the plain autoregressive generation of the same prompt, or None.

    Returns:
        The row's decoding keys (see the module's schema).
    """
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
        # per step: tokens each drafter forward fed (the step's shape: a replay's speed can be modelled
        # again from them under another machine's calibration, omnidraft.replay.row_shapes)
        "sd/step_feeds": [list(st.draft_feeds) for st in sd.steps],
    }
    if any(st.draft_hidden for st in sd.steps):  # the forwards also returned hidden states (the head's)
        row["sd/step_hidden"] = [int(st.draft_hidden) for st in sd.steps]
    if any(st.source == "lookup" for st in sd.steps):  # which steps prompt lookup proposed
        row["sd/step_lookup"] = [int(st.source == "lookup") for st in sd.steps]
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


def _by_source(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Acceptance and emitted tokens per step of the steps prompt lookup proposed and of those the
    drafter LM did (rows with ``sd/step_lookup``); steps that proposed nothing count for neither."""
    acc = {"lookup": [0, 0, 0], "model": [0, 0, 0]}  # proposed, accepted, steps
    for r in rows:
        for p, a, lk in zip(r["sd/step_proposed"], r["sd/step_accepted"], r["sd/step_lookup"]):
            if p:
                c = acc["lookup" if lk else "model"]
                c[0] += p
                c[1] += a
                c[2] += 1
    out: dict[str, float] = {}
    for src, (p, a, n) in acc.items():
        if n:
            out[f"draft/{src}_accept_rate"] = a / p
            out[f"draft/{src}_tokens_per_step"] = (a + n) / n
    return out


def drafter_row(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Per-prompt drafter statistics from cumulative counters (n-gram cache size, hits per step).

    Args:
        before: the drafter's counters before the generation.
        after: its counters after it.
        steps: the generation's verification steps.

    Returns:
        ``draft/mean_len`` (drafter-LM tokens per step), the ``ngram/*`` keys the drafter counts and,
        where prompt lookup is consulted first, ``draft/lookup_steps`` and ``draft/lookup_tokens``.
    """
    row: dict[str, float] = {}
    if "draft/tokens" in after:
        row["draft/mean_len"] = (after["draft/tokens"] - before.get("draft/tokens", 0)) / max(1, steps)
    if "ngram/size" in after:
        row["ngram/size"] = after["ngram/size"]
        row["ngram/bytes"] = after["ngram/bytes"]
        row["ngram/hits"] = after["ngram/proposed_hits"] - before.get("ngram/proposed_hits", 0)
        row["ngram/hits_per_step"] = row["ngram/hits"] / max(1, steps)
    if "draft/lookup_steps" in after:  # a model drafter consulting prompt lookup first
        row["draft/lookup_steps"] = after["draft/lookup_steps"] - before.get("draft/lookup_steps", 0)
        row["draft/lookup_tokens"] = after["draft/lookup_tokens"] - before.get("draft/lookup_tokens", 0)
    return row


def bench_row(method: str, task: str, prompt_id: str, index: int, res: GenerationResult, ar: GenerationResult,
              forward_s: float | None, rss_gib: float, update: dict[str, float]) -> dict[str, Any]:
    """One bench generation: a stream row's decoding keys plus what the bench measures.

    Args:
        method: the method (or variant) label.
        task: the prompt's task.
        prompt_id: the task record's id.
        index: the prompt's position in the bench.
        res: the method's generation.
        ar: ``ar``'s generation of the same prompt (the bench runs it on every prompt).
        forward_s: seconds inside model forwards (None when the bench does not profile).
        rss_gib: process RSS after the generation.
        update: the method's online update after the prompt (``adapt/update_s`` when one ran).

    Returns:
        The row (see the module's schema).
    """
    return {"method": method, "task": task, "prompt/id": prompt_id, "prompt/index": index,
            **prompt_row(res, ar), "sd/forward_s": forward_s, "mem/rss_gib": rss_gib, **update}


def normalise_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row in the schema's keys: legacy bench keys renamed (:data:`LEGACY_BENCH_KEYS`).

    Args:
        row: a row as written (any age).

    Returns:
        The row with schema keys, in the same order; schema rows come back equal.
    """
    return {LEGACY_BENCH_KEYS.get(k, k): v for k, v in row.items() if not (k == "adapt_s" and not v)}


def _first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------------- aggregation


def total(rows: list[dict[str, Any]], key: str, zero: float = 0) -> float:
    """Sum of ``key`` over ``rows``; a row without it (or with None) counts ``zero``."""
    return sum(r.get(key) or zero for r in rows)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def modelled_speedup(tokens_per_step: float, sd_step_s: float, ar_step_s: float) -> float:
    """The paper / Medusa convention: tokens per step over the relative step latency.

    ``speed/modelled_speedup`` of :func:`summarise` (from measured step times) and of
    :func:`omnidraft.calibrate.modelled_speedup` (from a latency calibration) are this one formula.

    Args:
        tokens_per_step: new target tokens per speculative step (``accept/mean_len``).
        sd_step_s: seconds of one speculative step (drafting + verification, prefill excluded).
        ar_step_s: seconds of one plain autoregressive step (a one-token target forward).

    Returns:
        ``tokens_per_step / (sd_step_s / ar_step_s)``; 0.0 where a denominator is 0.
    """
    return _ratio(tokens_per_step, _ratio(sd_step_s, ar_step_s))


def acceptance(rows: list[dict[str, Any]]) -> float | None:
    """Accepted over proposed tokens, totals over ``rows`` (None when nothing was proposed)."""
    p = total(rows, "sd/proposed")
    return total(rows, "sd/accepted") / p if p else None


def tok_per_s(rows: list[dict[str, Any]], side: str = "sd") -> float:
    """New tokens over wall seconds, totals over ``rows``, of ``side`` (``sd`` or ``ar``)."""
    return _ratio(total(rows, f"{side}/new_tokens"), total(rows, f"{side}/wall_s"))


def speedup(rows: list[dict[str, Any]]) -> float | None:
    """Tokens/s of the method over ar's on the rows that measured ar (None without any)."""
    paired = [r for r in rows if "ar/new_tokens" in r]
    return _ratio(tok_per_s(paired), tok_per_s(paired, "ar")) if paired else None


def drafted_per_step(rows: list[dict[str, Any]]) -> float:
    """Drafter tokens per step over ``rows`` (rows without ``draft/mean_len`` count 0)."""
    drafted = sum((r.get("draft/mean_len") or 0) * r["sd/steps"] for r in rows)
    return drafted / (total(rows, "sd/steps") or 1)


def head_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """Mean of a head calibration ``key`` weighted by ``head/n`` (the proposals each row saw);
    None when a row lacks the key (rows written before it existed)."""
    if not all(key in r for r in rows):
        return None
    return sum(r[key] * r["head/n"] for r in rows) / total(rows, "head/n")


def windows(rows: list[dict[str, Any]], window: int) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """The first and last ``window`` rows; short runs get two halves, never overlapping windows.

    Returns:
        ``(w, first, last)``, ``w`` the window length used.
    """
    w = max(1, min(window, len(rows) // 2))
    return w, rows[:w], rows[-w:]


def summarise(rows: list[dict[str, Any]], greedy: bool, window: int = 50) -> dict[str, Any]:
    """Aggregate rows: totals first, ratios of totals (not means of ratios).

    The one aggregation of the stream runner's summary, the bench's per-method results
    (:func:`bench_summary`) and the tables.

    Args:
        rows: schema rows, in stream order.
        greedy: whether decoding was greedy (then ``lossless/match_rate`` is reported).
        window: prompts in the first and last acceptance windows.

    Returns:
        ``n_prompts``, ``accept/*``, ``speed/*`` (``speed/speedup`` etc. over the rows that
        measured ar), ``time/*`` shares, and the ``adapt/``, ``draft/``, ``head/``, ``ngram/``
        keys the rows carry.
    """
    s: dict[str, Any] = {"n_prompts": len(rows)}
    if not rows:
        return s
    proposed, steps = total(rows, "sd/proposed"), total(rows, "sd/steps")
    new, wall = total(rows, "sd/new_tokens"), total(rows, "sd/wall_s")
    s["accept/rate"] = acceptance(rows) or 0.0
    s["accept/mean_len"] = _ratio(new, steps)
    s["accept/proposed_per_step"] = _ratio(proposed, steps)
    s["speed/sd_tok_per_s_all"] = _ratio(new, wall)
    s["time/draft_share"] = _ratio(total(rows, "sd/draft_s"), wall)
    s["time/target_share"] = _ratio(total(rows, "sd/target_s"), wall)
    s["accept/window"], first, last = windows(rows, window)
    s["accept/rate_first_window"] = acceptance(first) or 0.0
    s["accept/rate_last_window"] = acceptance(last) or 0.0
    if any("adapt/update_s" in r for r in rows):
        up = total(rows, "adapt/update_s")
        s["adapt/time_share"] = up / (up + wall + total(rows, "ar/wall_s"))
        s["adapt/n_updates"] = sum("adapt/update_s" in r for r in rows)
    dr = [r for r in rows if "draft/mean_len" in r]  # rows logged by code that counted drafted tokens
    if dr:
        s["draft/mean_len"] = _ratio(sum(r["draft/mean_len"] * r["sd/steps"] for r in dr), total(dr, "sd/steps"))
    lr = [r for r in rows if "draft/lookup_steps" in r]
    if lr:
        s["draft/lookup_step_share"] = _ratio(total(lr, "draft/lookup_steps"), total(lr, "sd/steps"))
    s.update(_by_source([r for r in rows if "sd/step_lookup" in r]))
    hr = [r for r in rows if "head/pred_accept" in r]
    if hr:
        n = total(hr, "head/n")
        s["head/pred_accept"] = sum(r["head/pred_accept"] * r["head/n"] for r in hr) / n
        s["head/obs_accept"] = sum(r["head/obs_accept"] * r["head/n"] for r in hr) / n
        dr = [r for r in hr if "head/pred_accept_debiased" in r]
        if dr:
            s["head/pred_accept_debiased"] = sum(r["head/pred_accept_debiased"] * r["head/n"] for r in dr) / \
                total(dr, "head/n")
    if "ngram/size" in rows[-1]:
        s["ngram/size"] = rows[-1]["ngram/size"]
        s["ngram/bytes"] = rows[-1]["ngram/bytes"]
        s["ngram/hits_per_step"] = _ratio(total(rows, "ngram/hits"), steps)
    paired = [r for r in rows if "ar/new_tokens" in r]
    s["n_baseline_prompts"] = len(paired)
    if paired:
        s["speed/sd_tok_per_s"] = tok_per_s(paired)
        s["speed/ar_tok_per_s"] = tok_per_s(paired, "ar")
        s["speed/speedup"] = speedup(paired)
        if all("ar/steps" in r for r in paired):  # legacy bench rows did not record ar's steps
            sd_step = _ratio(total(paired, "sd/draft_s") + total(paired, "sd/target_s"), total(paired, "sd/steps"))
            ar_step = _ratio(total(paired, "ar/target_s"), total(paired, "ar/steps"))
            s["speed/sd_step_s"] = sd_step
            s["speed/ar_step_s"] = ar_step
            s["speed/modelled_speedup"] = modelled_speedup(
                _ratio(total(paired, "sd/new_tokens"), total(paired, "sd/steps")), sd_step, ar_step)
        if greedy:
            s["lossless/match_rate"] = sum(bool(r["lossless/match"]) for r in paired) / len(paired)
            # a divergence certified a numerical near-tie (omnidraft.core.certify) is explained; any other is not
            s["lossless/near_tie_rate"] = sum(bool(r.get("lossless/near_tie")) for r in paired) / len(paired)
            s["lossless/unexplained"] = sum(not r["lossless/match"] and not r.get("lossless/near_tie") for r in paired)
    modelled = [r for r in rows if "speed/modelled_sd_s" in r]  # engine=replay: a latency calibration's model
    if modelled:
        n_steps = total(modelled, "sd/steps")
        s["speed/sd_step_s"] = _ratio(total(modelled, "speed/modelled_sd_s"), n_steps)
        # one plain step: the same on every row of one target and machine; rows of several (a target-switch
        # stream, seeds modelled on two machines) take its mean weighted by each row's new tokens, so that
        # plain decoding's modelled time is each row's tokens at its own target's step (as the cells'
        # bootstrap does, omnidraft.paper_tables._stats)
        ar = [r["speed/modelled_ar_step_s"] for r in modelled]
        new = total(modelled, "sd/new_tokens")
        ar_time = sum(a * (r.get("sd/new_tokens") or 0) for a, r in zip(ar, modelled))
        s["speed/ar_step_s"] = ar[0] if len(set(ar)) == 1 else (ar_time / new if new else sum(ar) / len(ar))
        s["speed/modelled_speedup"] = modelled_speedup(_ratio(new, n_steps), s["speed/sd_step_s"],
                                                       s["speed/ar_step_s"])
    return s


# the keys of one evaluation in a train_test run's ``dynamics`` (the paper's Figure 2)
DYNAMICS_KEYS = ("n_prompts", "accept/rate", "accept/mean_len", "speed/speedup", "speed/modelled_speedup")


def train_test_summary(rows: list[dict[str, Any]], greedy: bool, window: int = 50) -> dict[str, Any]:
    """The summary of a ``protocol=train_test`` run.

    Args:
        rows: the run's rows: ``phase`` train (the adapting stream) or test (``eval/at``: after that
            many train prompts, the drafter frozen).
        greedy: as :func:`summarise`.
        window: as :func:`summarise`.

    Returns:
        :func:`summarise` and the quality of the LAST evaluation's test rows at the top level (the
        paper's Table 1: results on the test set after training), with its ``eval/at``; the train
        stream's ``train/accept/*``, ``train/adapt/*``, ``train/ngram/*`` keys; and ``dynamics``,
        one entry per evaluation (``eval/at`` and :data:`DYNAMICS_KEYS`), in training order.
    """
    train = [r for r in rows if r.get("phase") == "train"]
    tests = [r for r in rows if r.get("phase") == "test"]
    ats = sorted({int(r["eval/at"]) for r in tests})
    by_at = {at: [r for r in tests if r["eval/at"] == at] for at in ats}
    s: dict[str, Any] = {}
    if ats:
        s.update(summarise(by_at[ats[-1]], greedy, window))
        s.update(summarise_quality(by_at[ats[-1]]))
        s["eval/at"] = ats[-1]
    s["n_train_prompts"] = len({r["prompt/index"] for r in train})
    if train:
        s.update({f"train/{k}": v for k, v in summarise(train, greedy, window).items()
                  if k.startswith(("accept/", "adapt/", "ngram/", "draft/", "head/"))})
    dyn = []
    for at in ats:
        e = summarise(by_at[at], greedy, window)
        dyn.append({"eval/at": at, **{k: e[k] for k in DYNAMICS_KEYS if k in e}})
    s["dynamics"] = dyn
    return s


def by_task(rows: list[dict[str, Any]], greedy: bool, window: int) -> dict[str, Any]:
    """Per-task acceptance and quality, for streams that mix tasks.

    Args:
        rows: the stream's rows.
        greedy: as :func:`summarise`.
        window: as :func:`summarise`.

    Returns:
        ``{"by_task": {task: {n_prompts, accept/rate, accept/mean_len, quality/*}}}``, or ``{}``
        when the rows come from fewer than two tasks.
    """
    tasks = sorted({r.get("task") for r in rows if r.get("task")})
    if len(tasks) < 2:
        return {}
    out = {}
    for name in tasks:
        rs = [r for r in rows if r.get("task") == name]
        s = summarise(rs, greedy, window)
        out[name] = {"n_prompts": len(rs), "accept/rate": s.get("accept/rate"),
                     "accept/mean_len": s.get("accept/mean_len"), **summarise_quality(rs)}
    return {"by_task": out}


def by_target(rows: list[dict[str, Any]], greedy: bool, window: int) -> list[dict[str, Any]]:
    """Acceptance per contiguous target segment of a target-switching stream, in stream order.

    Args:
        rows: the stream's rows (each with ``target``).
        greedy: as :func:`omnidraft.tables.summarise`.
        window: as :func:`omnidraft.tables.summarise`.

    Returns:
        One entry per segment: ``target``, ``first_prompt``, ``last_prompt``, ``n_prompts``,
        ``accept/rate``, ``accept/mean_len`` and, where measured, ``speed/speedup`` /
        ``speed/modelled_speedup``.
    """
    segs: list[list[dict[str, Any]]] = []
    for r in rows:
        if not segs or segs[-1][-1].get("target") != r.get("target"):
            segs.append([])
        segs[-1].append(r)
    out = []
    for rs in segs:
        s = summarise(rs, greedy, window)
        out.append({"target": rs[0].get("target"), "first_prompt": rs[0]["prompt/index"],
                    "last_prompt": rs[-1]["prompt/index"], "n_prompts": len({r["prompt/index"] for r in rs}),
                    "accept/rate": s.get("accept/rate"), "accept/mean_len": s.get("accept/mean_len"),
                    **{k: s[k] for k in ("speed/speedup", "speed/modelled_speedup") if k in s}})
    return out


def bench_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's bench results over its rows (each paired with ar's generation).

    :func:`summarise`'s ratios of totals, plus what the bench alone measures: the mean of
    per-prompt speedups, the framework overhead (share of wall time outside model forwards),
    memory, and the time totals.

    Args:
        rows: the method's bench rows (legacy keys are mapped), at least one.

    Returns:
        The :data:`BENCH_KEYS` and ``accept/proposed_per_step`` (mean draft length),
        ``time/{wall,forward,adapt,draft,target}_s``, ``time/steps``, ``n_prompts``, ``new_tokens``, and
        ``speed/free_draft_bound``: the speedup the method would reach were its drafting free, at its
        measured accepted length (its wall time less the decode loop's drafting seconds).
    """
    rows = [normalise_row(r) for r in rows]
    s = summarise(rows, greedy=True)
    wall = total(rows, "sd/wall_s", 0.0)
    draft = total(rows, "sd/draft_s", 0.0)
    profiled = all(r.get("sd/forward_s") is not None for r in rows)
    forward = total(rows, "sd/forward_s", 0.0) if profiled else None
    return {
        "speed/tok_per_s": s["speed/sd_tok_per_s_all"],
        "speed/speedup": s["speed/speedup"],
        "speed/speedup_mean_ratio": sum(r["speed/speedup"] for r in rows) / len(rows),
        "accept/rate": s["accept/rate"],
        "accept/mean_len": s["accept/mean_len"],
        "accept/proposed_per_step": s["accept/proposed_per_step"],  # mean draft length
        "lossless/match_rate": s["lossless/match_rate"],
        # certified divergences (benches before certification: None)
        "lossless/unexplained": s.get("lossless/unexplained") if all(
            r["lossless/match"] or "lossless/near_tie" in r for r in rows) else None,
        "overhead/share": (1.0 - forward / wall if wall else 0.0) if profiled else None,
        "mem/peak_rss_gib": max(r["mem/rss_gib"] for r in rows),
        "time/wall_s": wall, "time/forward_s": forward, "time/adapt_s": total(rows, "adapt/update_s", 0.0),
        # the decode loop's own split of the wall time (rows of benches older than it lack it)
        "time/draft_s": draft,
        "speed/free_draft_bound": s["speed/speedup"] * wall / (wall - draft) if wall > draft else None,
        "time/target_s": total(rows, "sd/target_s", 0.0),
        "time/steps": total(rows, "sd/steps"),
        "n_prompts": len(rows), "new_tokens": total(rows, "sd/new_tokens"),
    }


# ------------------------------------------------------------------------------ result files


def read_rows(run: Path) -> list[dict[str, Any]]:
    """The rows of a run directory's ``metrics.jsonl`` in schema keys ([] without one).

    Args:
        run: a stream run or bench run directory.
    """
    f = run / "metrics.jsonl"
    return [normalise_row(json.loads(x)) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def read_summary(run: Path) -> dict[str, Any]:
    """A run directory's ``summary.json`` as written ({} without one); ``provenance`` from
    ``provenance.json`` (written when the run started) when the summary lacks it.

    Args:
        run: a run directory.
    """
    s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    if "provenance" not in s and (run / "provenance.json").exists():
        s["provenance"] = json.loads((run / "provenance.json").read_text())
    return s


def run_summary(run: Path) -> tuple[dict[str, Any], bool]:
    """A stream run's summary, recomputed from its rows when the run is unfinished.

    Args:
        run: a stream run directory.

    Returns:
        ``(summary, partial)``: partial when the summary was not written with status ``ok``
        over all the rows of ``metrics.jsonl`` (a stream still running, or cut).
    """
    s = read_summary(run)
    rows = read_rows(run)
    done = s.get("status") == "ok" and s.get("n_prompts") == len(rows)
    if not done and rows:
        s = {**s, **summarise(rows, True, 50)}
    return s, not done


def runs_with_summary(results: Path) -> list[Path]:
    """Every run directory under ``results`` with a ``summary.json``, sorted by path."""
    return [p.parent for p in sorted(results.rglob("summary.json"))]


def read_bench(path: Path) -> dict[str, Any]:
    """A bench results JSON (``omnidraft bench``'s ``<name>.json``)."""
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------- rendering

GROUPS = ("core", "adaptive", "bench", "replay_check")
ORDER = {"core": ["spd_dm", "cache_pp", "dm_only", "omnidraft", "lora"],
         "adaptive": ["sv_fixed", "sv_heuristic", "sv_joint", "sv_interleaved", "xv_fixed", "xv_joint"]}
ALIAS = {("adaptive", "xv_fixed"): ("core", "omnidraft")}  # the same stream serves both tables
# Later GSM8K prompts are harder for every drafter, so a run's last window vs its first mixes
# learning with prompt difficulty. "gain" columns subtract the frozen drafter's acceptance on the
# SAME prompts (by prompt index) in each window: the frozen drafter for the core runs, the
# fixed-k run of the same pair for the adaptive ones.
REFERENCE = {"core": lambda name: ("core", "spd_dm"),
             "adaptive": lambda name: ("adaptive", "sv_fixed") if name.startswith("sv_") else ("core", "omnidraft")}
COLS = {
    "core": [("prompts", "n_prompts", "d"), ("acc first window", "accept/rate_first_window", ".3f"),
             ("acc last window", "accept/rate_last_window", ".3f"), ("acc all", "accept/rate", ".3f"),
             ("mean accepted len", "accept/mean_len", ".2f"), ("speedup", "speed/speedup", ".2f"),
             ("n-gram hits/step", "ngram/hits_per_step", ".3f"), ("cache size", "ngram/size", "d"),
             ("updates", "adapt/n_updates", "d"), ("update share", "adapt/time_share", ".1%"),
             ("equal to ar", "lossless/match_rate", ".2f")],
    "adaptive": [("prompts", "n_prompts", "d"), ("acc", "accept/rate", ".3f"),
                 ("acc last window", "accept/rate_last_window", ".3f"), ("mean accepted len", "accept/mean_len", ".2f"),
                 ("mean draft len", "draft/mean_len", ".2f"), ("speedup", "speed/speedup", ".2f"),
                 ("head pred", "head/pred_accept", ".3f"),
                 ("head pred debiased", "head/pred_accept_debiased", ".3f"), ("head obs", "head/obs_accept", ".3f"),
                 ("equal to ar", "lossless/match_rate", ".2f")],
}
BENCH_COLS = [("speedup", "speed/speedup", ".2f"), ("tok/s", "speed/tok_per_s", ".2f"), ("acc", "accept/rate", ".3f"),
              ("mean accepted len", "accept/mean_len", ".2f"), ("equal to ar", "lossless/match_rate", ".2f"),
              ("overhead", "overhead/share", ".1%")]


def _run_dir(results: Path, group: str, name: str) -> Path:
    return results / Path(*ALIAS.get((group, name), (group, name)))


def gains(rows: list[dict[str, Any]], ref: list[dict[str, Any]], window: int) -> tuple[float | None, float | None]:
    """(first-window, last-window) acceptance minus the reference run's on the same prompts.

    Args:
        rows: the run's rows.
        ref: the reference run's rows (matched by ``prompt/index``).
        window: as :func:`summarise`.

    Returns:
        The two gains; None where the reference lacks a window's prompts.
    """
    by_index = {r["prompt/index"]: r for r in ref}
    out = []
    for part in windows(rows, window)[1:]:
        if not part or any(r["prompt/index"] not in by_index for r in part):
            out.append(None)
            continue
        a, b = acceptance(part), acceptance([by_index[r["prompt/index"]] for r in part])
        out.append(None if a is None or b is None else a - b)
    return out[0], out[1]


def cpu(s: dict[str, Any]) -> str:
    """The CPU ISA each segment of a run ran on (speedups from different ISAs are not comparable:
    bf16 is native with AVX512-BF16 and emulated, several times slower, on AVX2).

    Args:
        s: a summary (or ``{"provenance": ...}``).
    """
    from omnidraft.data.models import native_bf16

    prov = s.get("provenance") or {}
    segs = prov.get("segments") or [prov]
    if len(segs) == 1 and "cpu_flags" not in segs[0]:  # segments recorded flags only later
        segs = [{**segs[0], "cpu_flags": prov.get("cpu_flags")}]

    def isa(g: dict) -> str:
        cap, flags = g.get("cpu_capability") or "unrecorded", g.get("cpu_flags")
        if flags is not None and native_bf16("cpu", set(flags)):
            cap += "-BF16"  # torch reports AVX512 with or without native bf16
        return cap

    return "+".join(dict.fromkeys(isa(g) for g in segs))


def dtype(run: Path) -> str:
    """The target's dtype as the run resolved it (config.yaml; `auto` is resolved before it is
    written): with the CPU column it says which kernels the speedup came from."""
    f = run / "config.yaml"
    if not f.exists():
        return "-"
    from omegaconf import OmegaConf

    return str(OmegaConf.load(f).target.dtype).replace("bfloat16", "bf16").replace("float32", "fp32")


def fmt(v: Any, f: str) -> str:
    """``v`` formatted with ``f`` (``d``: as an integer); ``-`` for None."""
    if v is None:
        return "-"
    return format(int(v), "d") if f == "d" else format(v, f)


def stream_table(group: str, results: Path) -> str:
    """One row per run of ``group`` (``core`` or ``adaptive``): its summary's columns, the gains
    over its reference run, CPU and dtype; runs without rows are marked ``not run``, unfinished
    ones ``(partial)``.

    Args:
        group: a key of :data:`ORDER`.
        results: the results directory.
    """
    cols = COLS[group]
    extra = ["reference", "gain first window", "gain last window", "CPU", "dtype"]
    lines = ["| " + " | ".join(["run", *(c for c, _, _ in cols), *extra]) + " |", "|" + "---|" * (len(cols) + 6)]
    for short in ORDER[group]:
        run = _run_dir(results, group, short)
        ref_dir = results / Path(*REFERENCE[group](short))
        ref = read_rows(ref_dir)
        if not (run / "metrics.jsonl").exists():
            lines.append(f"| {run.name} | " + " | ".join(["not run"] + [""] * (len(cols) + 4)) + " |")
            continue
        s, partial = run_summary(run)
        name = run.name if run.parent.name == group else f"{run.parent.name}/{run.name}"
        name += " (partial)" if partial else ""
        g = gains(read_rows(run), ref, int(s.get("accept/window") or 50)) if ref else (None, None)
        lines.append(f"| {name} | " + " | ".join(fmt(s.get(k), f) for _, k, f in cols) + f" | {ref_dir.name}"
                     + "".join(f" | {fmt(x, '+.3f')}" for x in g) + f" | {cpu(s)} | {dtype(run)} |")
    return "\n".join(lines) + "\n"


def blocks(group: str, results: Path, size: int = 50) -> str:
    """Per block of ``size`` prompts (by prompt index): acceptance, mean accepted length (tokens
    per target forward) and mean draft length (drafter tokens per step) of every run with rows,
    and the speedup over the block's prompts that measured ar; sums over the block, not means.

    Args:
        group: a key of :data:`ORDER`.
        results: the results directory.
        size: prompts per block.
    """
    runs = [(n, read_rows(_run_dir(results, group, n))) for n in ORDER[group]]
    runs = [(n, rows) for n, rows in runs if rows]
    if not runs:
        return ""
    n_max = max(max(x["prompt/index"] for x in rows) + 1 for _, rows in runs)
    lines = [f"Per {size}-prompt block: acceptance / mean accepted len / mean draft len / speedup", "",
             "| prompts | " + " | ".join(n for n, _ in runs) + " |", "|" + "---|" * (len(runs) + 1)]
    for lo in range(0, n_max, size):
        cells = []
        for _, all_rows in runs:
            rows = [x for x in all_rows if lo <= x["prompt/index"] < lo + size]
            steps = total(rows, "sd/steps")
            if not rows or not steps:
                cells.append("-")
                continue
            cells.append(f"{fmt(acceptance(rows), '.3f')} / {total(rows, 'sd/new_tokens') / steps:.2f} / "
                         f"{drafted_per_step(rows):.2f} / {fmt(speedup(rows), '.2f')}"
                         + ("" if len(rows) == size else f" ({len(rows)})"))
        lines.append(f"| {lo}-{lo + size - 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def head_intervals(group: str, results: Path, size: int = 8) -> str:
    """Runs with an acceptance head, per ``size`` prompts (the distillation interval): draft length,
    acceptance and the head's mean prediction (raw, debiased) vs the observed acceptance, so the
    effect of each update on the stop rule shows.

    Args:
        group: a key of :data:`ORDER`.
        results: the results directory.
        size: prompts per interval.
    """
    out = []
    for n in ORDER[group]:
        rows = [x for x in read_rows(_run_dir(results, group, n)) if x.get("head/n")]
        if not rows:
            continue
        out += [f"{n}: per {size} prompts, drafter tokens per step / acceptance / head raw / debiased / observed", "",
                "| prompts | draft len | acc | head raw | head debiased | observed |", "|---|---|---|---|---|---|"]
        for lo in range(0, len(rows), size):
            rs = rows[lo: lo + size]
            heads = [fmt(head_mean(rs, k), ".3f") for k in ("head/pred_accept", "head/pred_accept_debiased",
                                                             "head/obs_accept")]
            out.append(f"| {rs[0]['prompt/index']}-{rs[-1]['prompt/index']} | {drafted_per_step(rs):.2f} | "
                       f"{fmt(acceptance(rs), '.3f')} | " + " | ".join(heads) + " |")
        out.append("")
    return "\n".join(out)


NEW_DEFAULT = "omnidraft_pl"  # the framework's fastest OmniDraft configuration (conf/method/omnidraft_pl.yaml)


def bench_table(results: Path) -> str:
    """The issue-6 bench: one bench process per task (``results/bench/runs/<task>/``, each with every
    method interleaved per prompt), a column block per task and one over all prompts (ratios of
    totals over the rows, as the bench computes them), then the issue's targets checked.

    Args:
        results: the results directory.
    """
    runs = sorted(d for d in (results / "bench" / "runs").glob("*") if (d / "metrics.jsonl").exists())
    if not runs:
        return "no bench runs under results/bench/runs/\n"
    rows = [r for d in runs for r in read_rows(d)]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))

    def done(task: str | None) -> list[dict]:  # prompts every method finished (a cut bench can end mid-prompt)
        rs = [r for r in rows if task is None or r["task"] == task]
        keys = [{(r["task"], r["prompt/index"]) for r in rs if r["method"] == m} for m in methods]
        ok = set.intersection(*keys) if keys else set()
        return [r for r in rs if (r["task"], r["prompt/index"]) in ok]

    parts = [(t, done(t)) for t in tasks] + ([("all", done(None))] if len(tasks) > 1 else [])
    aggs = {name: {m: bench_summary([r for r in rs if r["method"] == m]) for m in methods} for name, rs in parts if rs}
    head = "| method | " + " | ".join(f"{name} {c}" for name in aggs for c, _, _ in BENCH_COLS) + " |"
    lines = []
    for d in runs:  # where and how each bench process ran
        s = read_summary(d)
        g = s.get("provenance", {})
        lines.append(f"- {d.name}: git {str(g.get('git_hash'))[:10]}{' (dirty)' if g.get('git_dirty') else ''}, "
                     f"{g.get('cpu')} ({cpu(s)}), torch threads {g.get('torch_threads')}, target dtype {dtype(d)}")
    lines += ["", "prompts per block: " + ", ".join(f"{name} {a[methods[0]]['n_prompts']}" for name, a in aggs.items()),
              "", head, "|" + "---|" * (1 + len(aggs) * len(BENCH_COLS))]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(fmt(aggs[name][m].get(k), f) for name in aggs for _, k, f in BENCH_COLS)
                     + " |")
    lines += ["", "Targets (issues 6 and 30), per block:", ""]
    for name, a in aggs.items():
        sp = {m: a[m]["speed/speedup"] for m in methods}
        checks = []
        if "spd_dm" in sp and "uag_k5" in sp:
            checks.append(f"spd_dm {sp['spd_dm']:.2f}x vs uag_k5 {sp['uag_k5']:.2f}x: "
                          f"{'met' if sp['spd_dm'] >= sp['uag_k5'] else 'missed'} ({sp['spd_dm'] / sp['uag_k5']:.2f}x)")
        for u in ("uag", "uag_k5"):
            if "omnidraft" in sp and u in sp:
                r = sp["omnidraft"] / sp[u]
                checks.append(f"omnidraft / {u} {r:.2f} (target >= 1.3: {'met' if r >= 1.3 else 'missed'})")
        if NEW_DEFAULT in sp:  # issue 30: the new default against transformers' assisted generation and PLD
            need = 1.3 if name == "all" else 1.1
            for ref, bar in (("uag_k5", need), ("pld", 1.0)):
                if ref in sp:
                    r = sp[NEW_DEFAULT] / sp[ref]
                    checks.append(f"{NEW_DEFAULT} / {ref} {r:.2f} (target >= {bar:g}: {'met' if r >= bar else 'missed'})")
        differ = {m: round((1 - a[m]["lossless/match_rate"]) * a[m]["n_prompts"]) for m in methods}
        if any(differ.values()) and all(a[m].get("lossless/unexplained") is not None for m in methods):
            checks.append("outputs differing from ar certified numerical near-ties: " + ", ".join(
                f"{m} {differ[m] - a[m]['lossless/unexplained']} of {differ[m]}" for m in methods if differ[m]))
        over = {m: a[m]["overhead/share"] for m in methods if m != "ar" and a[m]["overhead/share"] is not None}
        if over:
            worst = max(over, key=over.get)
            checks.append(f"largest overhead {over[worst]:.1%} ({worst}; target <= 10%: "
                          f"{'met' if over[worst] <= 0.10 else 'missed'})")
        lines.append(f"- {name}: " + "; ".join(checks))
    for name, rs in parts:  # where the time goes: the decode loop's draft/verify split, per step
        if not rs or name == "all" or any("sd/draft_s" not in r for r in rs):
            continue  # rows of benches older than the split lack it
        lines += ["", (f"Time per step, {name} (draft and verify phases as the decode loop times them; uag: "
                       "between and in the target's forwards):"), "",
                  ("| method | steps | draft s/step | verify s/step | drafted tok/step | draft s/drafted tok "
                   "| wall s/token | free-drafting bound | of bound |"), "|---|---|---|---|---|---|---|---|---|"]
        for m in methods:
            a = aggs[name][m]
            st, pr = max(1, a["time/steps"]), total([r for r in rs if r["method"] == m], "sd/proposed")
            bound = a.get("speed/free_draft_bound")
            lines.append(f"| {m} | {a['time/steps']} | {a['time/draft_s'] / st:.3f} | {a['time/target_s'] / st:.3f} | "
                         f"{pr / st:.2f} | {a['time/draft_s'] / pr if pr else 0:.3f} | "
                         f"{a['time/wall_s'] / max(1, a['new_tokens']):.3f} | {fmt(bound, '.2f')} | "
                         f"{fmt(a['speed/speedup'] / bound if bound else None, '.0%')} |")
    return "\n".join(lines) + "\n"


def bench_markdown(result: dict[str, Any]) -> str:
    """One bench's Markdown report, from its results JSON: a table over all prompts and one per task.

    Args:
        result: what ``omnidraft bench`` returns (and writes as ``<name>.json``).
    """
    cols = ["method", "tok/s", "speedup", "speedup (mean of ratios)", "accept rate", "mean accepted len",
            "draft len", "equal to ar", "overhead", "peak RSS GiB", "own GiB", "adapt s"]
    prov = result["provenance"]
    lines = [f"# Bench: {result['target']} <- {result['drafter']}, tasks {', '.join(result['tasks'])}", "",
             (f"{result['n_prompts']} prompts ({result['limit_per_task']} per task), "
              f"{result['max_new_tokens']} new tokens, temperature {result['temperature']}, status {result['status']}. "
              f"Git {str(prov.get('git_hash'))[:10]}{' (dirty)' if prov.get('git_dirty') else ''}, "
              f"{prov.get('cpu')} ({prov.get('cpu_capability')}), torch threads {prov.get('torch_threads')}.")]
    per_task = {t: o for t, o in (result.get("task_overrides") or {}).items() if o and t in result["tasks"]}
    if per_task:
        lines.append("Task overrides: " + "; ".join(f"{t}: {' '.join(o)}" for t, o in per_task.items()) + ".")
    variants = {m: v for m, v in (result.get("variants") or {}).items() if m in result.get("methods", {})}
    if variants:
        lines.append("Variants: " + "; ".join(f"{m} = {v['method']} {' '.join(v.get('overrides') or [])}".rstrip()
                                               for m, v in variants.items()) + ".")
    per_method = {m: o for m, o in (result.get("method_overrides") or {}).items() if o}
    if per_method:
        lines.append("Method overrides: " + "; ".join(f"{m}: {' '.join(o)}" for m, o in per_method.items()) + ".")
    lines.append("")

    def table(ms: dict[str, Any]) -> list[str]:
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for m, a in ms.items():
            out.append(f"| {m} | {a['speed/tok_per_s']:.2f} | {a['speed/speedup']:.3f}x | "
                       f"{a['speed/speedup_mean_ratio']:.3f}x | {a['accept/rate']:.3f} | {a['accept/mean_len']:.2f} | "
                       f"{fmt(a.get('accept/proposed_per_step'), '.2f')} | "
                       f"{a['lossless/match_rate']:.2f} | {fmt(a['overhead/share'], '.1%')} | "
                       f"{a['mem/peak_rss_gib']:.2f} | {a['mem/own_gib']:.2f} | {a['time/adapt_s']:.1f} |")
        return out

    if result["methods"]:
        lines += ["## All prompts", ""] + table(result["methods"])
        for t, ms in result.get("per_task", {}).items():
            lines += ["", f"## {t}", ""] + table(ms)
    if result["methods"]:
        lim = [f"{m} {a['speed/speedup']:.2f}x of {a['speed/free_draft_bound']:.2f}x "
               f"({a['speed/speedup'] / a['speed/free_draft_bound']:.0%})"
               for m, a in result["methods"].items() if m != "ar" and a.get("speed/free_draft_bound")]
        if lim:
            lines += ["", "Limit (speedup of the bound each method would reach with free drafting at its measured "
                      "accepted length): " + "; ".join(lim) + "."]
    lines += ["", ("Speedup: tokens/s of the method over tokens/s of ar on the same prompts (ratio of totals). "
                   "Overhead: share of the method's generation wall time outside model forward passes. "
                   "Peak RSS: the process's resident memory sampled after each of the method's generations "
                   "(all methods share one process and one target, so it is mostly common). Own GiB: memory only "
                   "this method holds (its own drafter copy, fp32 training copy and optimiser state).")]
    return "\n".join(lines) + "\n"


def compare_runs(live: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """How far a run (a replay) reproduces another (the live one) on the same prompts.

    Args:
        live: the reference run's rows.
        other: the compared run's rows (matched by phase, ``eval/at``, prompt index and turn).

    Returns:
        ``prompts`` (matched), ``prompts_same_steps`` / ``steps_same`` (identical per-step
        (proposed, accepted)), ``outputs_same`` (identical text), ``updates`` and
        ``loss_max_rel_diff`` (largest relative difference of ``adapt/loss`` over the updates).
    """
    key = lambda r: (r.get("phase"), r.get("eval/at"), r["prompt/index"], r.get("prompt/turn", 0))  # noqa: E731
    theirs = {key(r): r for r in other}
    pairs = [(r, theirs[key(r)]) for r in live if key(r) in theirs]
    out: dict[str, Any] = {"prompts": len(pairs), "prompts_same_steps": 0, "steps": 0, "steps_same": 0,
                           "outputs_same": 0, "updates": 0, "loss_max_rel_diff": 0.0}
    for a, b in pairs:
        sa = list(zip(a["sd/step_proposed"], a["sd/step_accepted"]))
        sb = list(zip(b["sd/step_proposed"], b["sd/step_accepted"]))
        out["prompts_same_steps"] += sa == sb
        out["steps"] += len(sa)
        out["steps_same"] += sum(x == y for x, y in zip(sa, sb))
        out["outputs_same"] += a.get("text/output") == b.get("text/output")
        if "adapt/loss" in a and "adapt/loss" in b:
            out["updates"] += 1
            rel = abs(a["adapt/loss"] - b["adapt/loss"]) / max(abs(a["adapt/loss"]), 1e-12)
            out["loss_max_rel_diff"] = max(out["loss_max_rel_diff"], rel)
    return out


def _wall(rows: list[dict[str, Any]]) -> float:
    """Seconds a stream spent decoding (its method and, where measured, ar) and updating."""
    return total(rows, "sd/wall_s") + total(rows, "ar/wall_s") + total(rows, "adapt/update_s")


def replay_check_table(results: Path) -> str:
    """``results/replay_check/``: the ``live`` run against every other run there (replays of it),
    then every pair of those others (a replay on two CPUs, thread counts or rows modes: machine independence).

    One row per run: how many prompts and steps it reproduces, identical outputs, the updates'
    largest relative loss difference, its acceptance, its decoding + update seconds, speedups, CPU
    and threads; one row per pair of the other runs: the same comparison between the two.
    """
    base = results / "replay_check"
    if not (base / "live" / "metrics.jsonl").is_file():
        raise OmniDraftError(f"tables replay_check compares runs with {base / 'live'}, which holds no metrics.jsonl: "
                             "run the live stream there first (hydra.run.dir=<results>/replay_check/live)")
    live = read_rows(base / "live")

    def compared(c: dict[str, Any]) -> list[str]:
        return [str(c["prompts"]), f"{c['prompts_same_steps']}/{c['prompts']}", f"{c['steps_same']}/{c['steps']}",
                f"{c['outputs_same']}/{c['prompts']}", str(c["updates"]), f"{c['loss_max_rel_diff']:.1e}"]

    same = ["prompts", "prompts with identical steps", "identical steps", "identical outputs", "updates",
            "max loss rel diff"]
    head = ["run", "engine", *same, "acceptance", "decode+update s", "speedup", "CPU", "threads"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # a run directory holds a run's rows; the check's own target trace (trace.jsonl) is no run
    runs = sorted(p for p in base.iterdir()
                  if p.is_dir() and (p / "metrics.jsonl").exists() and not (p / "trace.jsonl").exists())
    rows_of = {d.name: read_rows(d) for d in runs}
    for d in runs:
        rows, summ = rows_of[d.name], read_summary(d)
        prov = summ.get("provenance") or {}
        replayed = summ.get("engine") == "replay"
        sp = summ.get("speed/modelled_speedup") if replayed else summ.get("speed/speedup")
        speed = "-" if sp is None else f"{sp:.2f}x" + (" (modelled)" if replayed else "")
        acc = acceptance(rows)
        lines.append("| " + " | ".join([
            d.name, str(summ.get("engine", "live")), *compared(compare_runs(live, rows)),
            "-" if acc is None else f"{acc:.4f}", f"{_wall(rows):.1f}", speed,
            str(prov.get("cpu_capability", "?")), str(prov.get("torch_threads", "?"))]) + " |")
    text = ("Replay against the live run (`live`): per-step (proposed, accepted), outputs and update losses, "
            "matched by prompt.\n\n" + "\n".join(lines) + "\n")
    others = [d.name for d in runs if d.name != "live"]
    pairs = [(a, b) for i, a in enumerate(others) for b in others[i + 1:]]
    if pairs:
        lines = ["| run | against | " + " | ".join(same) + " |", "|" + "---|" * (2 + len(same))]
        lines += ["| " + " | ".join([a, b, *compared(compare_runs(rows_of[a], rows_of[b]))]) + " |" for a, b in pairs]
        text += ("\nThe other runs against each other (the same run on another CPU, thread count or rows mode: "
                 "whether its figures depend on them).\n\n" + "\n".join(lines) + "\n")
    return text


def render(group: str, results: Path) -> str:
    """The text of ``results/<group>/table.md``.

    ``core`` and ``adaptive``: :func:`stream_table` over ``results/<group>/*/`` then :func:`blocks`
    (per-50-prompt acceptance, mean accepted length, mean draft length, speedup over the block's
    prompts that measured ar), ``adaptive`` also :func:`head_intervals`; ``bench``:
    :func:`bench_table` over ``results/bench/runs/*/metrics.jsonl``.

    A summary written while its stream was still running (or none: the stream's metrics.jsonl
    alone) is recomputed from metrics.jsonl and marked partial. "gain first/last window" is a run's
    acceptance minus its reference run's (spd_dm; sv_fixed or the cross-vocab omnidraft for the
    adaptive table) on the same prompts, so prompt difficulty cancels out. The CPU column is torch's
    capability per segment and the dtype column the target's (bf16 is emulated, several times
    slower, on CPUs without AVX512-BF16/AMX: speedups from such runs are not comparable).

    Args:
        group: one of :data:`GROUPS`.
        results: the results directory.
    """
    if group == "bench":
        return bench_table(results)
    if group == "replay_check":
        return replay_check_table(results)
    text = stream_table(group, results) + "\n" + blocks(group, results)
    if group == "adaptive":
        text += "\n" + head_intervals(group, results)
    return text


def write_table(group: str, results: Path) -> tuple[Path, str]:
    """Render ``group``'s table from the result files under ``results`` and write it.

    Args:
        group: one of :data:`GROUPS`.
        results: the results directory.

    Returns:
        ``(path, text)``: ``results/<group>/table.md`` and what was written to it.

    Raises:
        OmniDraftError: ``group`` is not one of :data:`GROUPS`.
    """
    if group not in GROUPS:
        raise OmniDraftError(f"tables: unknown group {group!r}; use one of {', '.join(GROUPS)}")
    text = render(group, results)
    out = results / group / "table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out, text
