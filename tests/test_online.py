"""Online hybrid distillation on tiny models with real tokenizers."""

from __future__ import annotations

import torch

from omnidraft.decode import generate
from omnidraft.drafters import NgramDrafter
from omnidraft.online import OnlineLearner

from conftest import PROMPTS, aligned_drafter


def _setup(pair_llama2_qwen):
    target, ttok, drafter0, dtok, bridge = pair_llama2_qwen
    drafter = aligned_drafter(target, bridge, len(dtok), seed=11, noise=0.2)  # own copy: it trains
    learner = OnlineLearner(drafter, bridge, lam=0.2, lr=1e-3, weight_decay=0.0, batch_size=4)
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id}, learner=learner)
    return target, ttok, drafter, d, learner


def test_update_lowers_hybrid_loss_and_never_touches_target(pair_llama2_qwen):
    target, ttok, drafter, d, learner = _setup(pair_llama2_qwen)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    for text in PROMPTS[:4]:
        ar = generate(target, ttok.encode(text), max_new_tokens=16)
        sd = generate(target, ttok.encode(text), drafter=d, k=4, max_new_tokens=16)
        assert sd.tokens == ar.tokens  # lossless while recording
    batch = list(learner.buffer)
    assert batch and any(ex.dm_pos for ex in batch)
    with torch.no_grad():
        before = float(learner.losses(batch)["loss"])
    learner.update()
    assert not learner.buffer
    with torch.no_grad():
        after = float(learner.losses(batch)["loss"])
    assert after < before
    assert any(not torch.equal(drafter_before[k], v) for k, v in drafter.state_dict().items())
    assert all(torch.equal(target_before[k], v) for k, v in target.state_dict().items())
    assert all(p.grad is None for p in target.parameters())
    assert all(not p.requires_grad for p in drafter.parameters()) and not drafter.training


def test_greedy_stays_lossless_while_training(pair_llama2_qwen):
    target, ttok, drafter, d, learner = _setup(pair_llama2_qwen)
    for i, text in enumerate(PROMPTS[:8]):
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=d, k=3, max_new_tokens=16).tokens == \
            generate(target, ids, max_new_tokens=16).tokens
        if i % 2 == 1:
            learner.update()
    assert learner.n_updates == 4


def test_lora_update_trains_only_adapters(pair_llama2_qwen):
    from omnidraft.online import with_lora

    target, ttok, drafter0, dtok, bridge = pair_llama2_qwen
    base = aligned_drafter(target, bridge, len(dtok), seed=12, noise=0.2)
    model = with_lora(base, rank=4, target_modules=["q_proj", "v_proj"])
    learner = OnlineLearner(model, bridge, lr=1e-2, weight_decay=0.0, batch_size=4)
    assert learner.params and all(p.ndim == 2 for p in learner.params)
    frozen = {n: p.clone() for n, p in model.named_parameters() if "lora_" not in n}
    d = NgramDrafter(model, dtok, bridge, target.config.vocab_size, learner=learner)
    for text in PROMPTS[:3]:
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=d, k=3, max_new_tokens=12).tokens == \
            generate(target, ids, max_new_tokens=12).tokens
    batch = list(learner.buffer)
    with torch.no_grad():
        before = float(learner.losses(batch)["loss"])
    learner.update()
    with torch.no_grad():
        after = float(learner.losses(batch)["loss"])
    assert after < before
    assert all(torch.equal(frozen[n], p) for n, p in model.named_parameters() if "lora_" not in n)
