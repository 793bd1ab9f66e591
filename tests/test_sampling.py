"""Monte-Carlo checks that speculative sampling reproduces the target's next-token distribution.

The same `sample_verify` and `lift_to_target` the decode loop uses; a wrong rule (resampling
from p instead of the residual) is shown to fail the same bound, so the test has power.
"""

from __future__ import annotations

import torch

from omnidraft.core.verify import lift_to_target, sample_verify

N = 20000
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = torch.tensor([0.05, 0.05, 0.10, 0.15, 0.25, 0.40])


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _first_token_hist(p_rows, draw, verify, v, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(v)
    for _ in range(n):
        ids, q_rows = draw(g)
        k, nxt = verify(p_rows, q_rows, ids, g)
        counts[ids[0] if k >= 1 else nxt] += 1
    return counts


def _wrong_verify(p, q, ids, g):
    """Resample from p on rejection (a classic bug): biased towards p's mass on the draft token."""
    r = p[0, ids[0]] / q[0, ids[0]]
    if torch.rand(1, generator=g) < r:
        return 1, 0
    return 0, int(torch.multinomial(p[0], 1, generator=g))


def test_sd_sampling_matches_target():
    m = 3
    p_rows = P.repeat(m + 1, 1)
    q_rows = Q.repeat(m, 1)

    def draw(g):
        return torch.multinomial(Q, m, replacement=True, generator=g), q_rows

    counts = _first_token_hist(p_rows, draw, sample_verify, len(P))
    assert _tv(counts, P) < 0.02
    wrong = _first_token_hist(p_rows, draw, _wrong_verify, len(P))
    assert _tv(wrong, P) > 0.05


def test_sd_bonus_token_follows_target():
    """With q == p every draft is accepted; the emitted token after them comes from p[m]."""
    g = torch.Generator().manual_seed(1)
    p_last = torch.tensor([0.1, 0.6, 0.3])
    p = torch.stack([torch.tensor([1.0, 0.0, 0.0]), p_last])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    counts = torch.zeros(3)
    for _ in range(5000):
        k, nxt = sample_verify(p, q, torch.tensor([0]), g)
        assert k == 1
        counts[nxt] += 1
    assert _tv(counts, p_last) < 0.03


def test_spd_dm_sampling_matches_target():
    """Drafter vocab of 7 mapped into a target vocab of 6: two drafter ids spell one target token,
    two are unmapped, and target tokens 2 and 4 are unreachable for the drafter."""
    d2t = torch.tensor([0, 1, 1, -1, 3, -1, 5])
    mask = d2t >= 0
    map_ids = mask.nonzero().squeeze(1)
    logits_d = torch.tensor([0.3, -0.2, 0.5, 2.0, 1.0, 1.5, 0.7])
    q_d = torch.softmax(logits_d.masked_fill(~mask, float("-inf")), -1)
    q_t = lift_to_target(q_d, map_ids, d2t[map_ids], 6)
    assert torch.isclose(q_t.sum(), torch.tensor(1.0))
    assert q_t[2] == 0 and q_t[4] == 0 and torch.isclose(q_t[1], q_d[1] + q_d[2])
    m = 2
    p_rows = P.repeat(m + 1, 1)
    q_rows = q_t.repeat(m, 1)

    def draw(g):
        d = torch.multinomial(q_d, m, replacement=True, generator=g)
        return d2t[d], q_rows

    counts = _first_token_hist(p_rows, draw, sample_verify, 6)
    assert _tv(counts, P) < 0.02
    wrong = _first_token_hist(p_rows, draw, _wrong_verify, 6)
    assert _tv(wrong, P) > 0.05


def test_greedy_verify_prefix_correction_and_bonus():
    from omnidraft.core.verify import greedy_verify

    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 5, 7, 9]):
        logits[row, tok] = 1.0
    assert greedy_verify(logits, [3, 5, 7]) == (3, 9)  # all accepted + bonus
    assert greedy_verify(logits, [3, 4, 7]) == (1, 5)  # correction at the first mismatch
    assert greedy_verify(logits[:1], []) == (0, 3)  # plain decoding step


def test_inverse_cdf_draws_the_distribution_and_never_a_zero_probability_token():
    from omnidraft.core.verify import inverse_cdf

    dist = torch.tensor([0.0, 0.40, 0.0, 0.25, 0.15, 0.10, 0.06, 0.04, 0.0])
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(len(dist))
    for u in torch.rand(N, generator=g):
        counts[inverse_cdf(dist, u)] += 1
    assert _tv(counts, dist) < 0.02
    assert counts[dist == 0].sum() == 0
    assert inverse_cdf(dist, torch.tensor(0.0)) == 1  # u = 0 lands on the first token with mass
    assert inverse_cdf(dist, torch.tensor(1.0 - 1e-12)) == 7  # and u -> 1 on the last


def test_sample_index_is_multinomial_where_the_generator_shares_the_device():
    """A CPU run draws exactly what torch.multinomial draws (the inverse CDF is for a model on
    another device than the run's generator)."""
    from omnidraft.core.verify import sample_index

    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [sample_index(P, a) for _ in range(50)] == [int(torch.multinomial(P, 1, generator=b)) for _ in range(50)]


def test_sd_sampling_matches_target_when_the_generator_lives_elsewhere(monkeypatch):
    """sample_verify with the cross-device draw (the inverse CDF at the generator's uniforms), as a
    model on CUDA with the run's CPU generator gets it: still the target's distribution."""
    from omnidraft.core import verify
    from omnidraft.core.verify import inverse_cdf

    monkeypatch.setattr(verify, "sample_index", lambda dist, g: inverse_cdf(dist, torch.rand(1, generator=g)))
    m = 3
    p_rows, q_rows = P.repeat(m + 1, 1), Q.repeat(m, 1)

    def draw(g):
        return torch.multinomial(Q, m, replacement=True, generator=g), q_rows

    counts = _first_token_hist(p_rows, draw, verify.sample_verify, len(P))
    assert _tv(counts, P) < 0.02
