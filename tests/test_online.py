"""Online hybrid distillation on tiny models with real tokenizers."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, aligned_drafter

from omnidraft.core.decode import generate
from omnidraft.drafting.model_drafters import NgramDrafter
from omnidraft.learn.observers import step_observers
from omnidraft.learn.online import OnlineLearner


def _setup(pair_llama2_qwen, loss="kl_nll"):
    target, ttok, drafter0, dtok, bridge = pair_llama2_qwen
    drafter = aligned_drafter(target, bridge, len(dtok), seed=11, noise=0.2)  # own copy: it trains
    learner = OnlineLearner(drafter, bridge, lam=0.2, lr=1e-3, weight_decay=0.0, batch_size=4, loss=loss)
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    return target, ttok, drafter, d, learner


@pytest.mark.parametrize("loss", ["kl_nll", "nll_only", "nll_nll", "kl_kl"])
def test_update_lowers_hybrid_loss_and_never_touches_target(pair_llama2_qwen, loss):
    target, ttok, drafter, d, learner = _setup(pair_llama2_qwen, loss)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    for text in PROMPTS[:4]:
        ar = generate(target, ttok.encode(text), max_new_tokens=16)
        sd = generate(target, ttok.encode(text), drafter=d, observers=step_observers(d, learner=learner), k=4, max_new_tokens=16)
        assert sd.tokens == ar.tokens  # lossless while recording
    batch = list(learner.buffer)
    assert batch and any(ex.dm_pos for ex in batch)
    # The tiny pair rarely accepts an n-gram: give every multi-token step one at its first two
    # drafts (target log-prob -0.1) so the n-gram terms of every variant are exercised.
    for ex in batch:
        if not ex.ngrams and len(ex.drafts) >= 3:
            ex.ngrams = [(0, 2, -0.1)]
            ex.dm_pos, ex.dm_logp, ex.dm_top = ex.dm_pos[1:], ex.dm_logp[1:], ex.dm_top[1:]
    learner.buffer = list(batch)
    with torch.no_grad():
        out = learner.losses(batch)
        before = float(out["loss"])
    assert before > 0 and (float(out["loss_dm"]) == 0) == (loss == "nll_only")
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
        assert generate(target, ids, drafter=d, observers=step_observers(d, learner=learner), k=3, max_new_tokens=16).tokens == \
            generate(target, ids, max_new_tokens=16).tokens
        if i % 2 == 1:
            learner.update()
    assert learner.n_updates == 4


def test_lora_update_trains_only_adapters_and_serves_them_merged(pair_llama2_qwen):
    """LoRA trains adapters on the training copy only; the served drafter stays a plain model whose
    adapted weights are base + delta: same logits as the adapter model, untouched elsewhere."""
    target, ttok, drafter0, dtok, bridge = pair_llama2_qwen
    model = aligned_drafter(target, bridge, len(dtok), seed=12, noise=0.2)
    base = {n: p.clone() for n, p in model.named_parameters()}
    learner = OnlineLearner(model, bridge, lr=1e-2, weight_decay=0.0, batch_size=4,
                            lora=(4, None, ["q_proj", "v_proj"]))
    assert learner.master and all("lora_" in n for n in learner.names) and not learner.params
    assert not any("lora_" in n for n, _ in model.named_parameters())  # served drafter: plain
    train_base = {n: p.clone() for n, p in learner.train_model.named_parameters() if "lora_" not in n}
    d = NgramDrafter(model, dtok, bridge, target.config.vocab_size)
    for text in PROMPTS[:3]:
        ids = ttok.encode(text)
        assert generate(target, ids, drafter=d, observers=step_observers(d, learner=learner), k=3, max_new_tokens=12).tokens == \
            generate(target, ids, max_new_tokens=12).tokens
    batch = list(learner.buffer)
    with torch.no_grad():
        before = float(learner.losses(batch)["loss"])
    learner.update()
    with torch.no_grad():
        after = float(learner.losses(batch)["loss"])
    assert after < before
    assert all(torch.equal(train_base[n], p) for n, p in learner.train_model.named_parameters() if "lora_" not in n)
    moved = {n for n, p in model.named_parameters() if not torch.equal(base[n], p)}
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in moved)
    dids = torch.tensor([dtok.encode(PROMPTS[0])[:12]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=dids).logits, learner.train_model(input_ids=dids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_lora_init_is_seeded():
    from transformers import LlamaConfig, LlamaForCausalLM

    from omnidraft.learn.lora import with_lora

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    a = [dict(with_lora(LlamaForCausalLM(cfg), 4, seed=s).named_parameters()) for s in (0, 0, 1)]
    lora_a = [n for n in a[0] if "lora_A" in n]
    assert lora_a and all(torch.equal(a[0][n], a[1][n]) for n in lora_a)
    assert any(not torch.equal(a[0][n], a[2][n]) for n in lora_a)
    plain = LlamaForCausalLM(cfg)
    rng_before = torch.random.get_rng_state()
    with_lora(plain, 4, seed=0)
    assert torch.equal(rng_before, torch.random.get_rng_state())  # the global RNG is left as it was


def test_context_grad_variant_and_master_weights(pair_llama2_qwen):
    """Both gradient variants lower the loss; the bf16 drafter still moves under a tiny lr
    because the optimiser steps on fp32 master copies."""
    target, ttok, drafter0, dtok, bridge = pair_llama2_qwen
    for context_grad, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        model = aligned_drafter(target, bridge, len(dtok), seed=13, noise=0.2).to(dtype)
        lr = 1e-3 if dtype == torch.float32 else 1e-5
        learner = OnlineLearner(model, bridge, lr=lr, weight_decay=0.0, batch_size=4, context_grad=context_grad)
        d = NgramDrafter(model, dtok, bridge, target.config.vocab_size)
        for text in PROMPTS[:3]:
            generate(target, ttok.encode(text), drafter=d, observers=step_observers(d, learner=learner), k=3, max_new_tokens=12)
        batch = list(learner.buffer)
        w0 = [p.clone() for p in learner.params]
        with torch.no_grad():
            before = float(learner.losses(batch)["loss"])
        for _ in range(3):
            learner.buffer = list(batch)
            learner.update(progress=False)
        with torch.no_grad():
            after = float(learner.losses(batch)["loss"])
        assert after < before, (context_grad, dtype)
        assert all(m.dtype == torch.float32 for m in learner.master)
        assert any(not torch.equal(a, b) for a, b in zip(w0, learner.params))


@pytest.mark.parametrize("pair", ["pair_llama2_qwen", "pair_llama2_llama3"])
def test_tree_attention_pass_equals_one_pass_per_example(pair, request):
    """The examples of one sequence share a cached context and go through ONE forward pass with
    a tree mask: logits, loss and gradients equal those of one pass per example (fp32)."""
    target, ttok, _, dtok, bridge = request.getfixturevalue(pair)
    drafter = aligned_drafter(target, bridge, len(dtok), seed=11, noise=0.2)
    learner = OnlineLearner(drafter, bridge, lr=1e-3, weight_decay=0.0, batch_size=8)
    assert learner.tree  # llama and qwen2 take the tree path
    d = NgramDrafter(drafter, dtok, bridge, target.config.vocab_size, {ttok.eos_token_id})
    for text in PROMPTS[:3]:
        generate(target, ttok.encode(text), drafter=d, observers=step_observers(d, learner=learner), k=4, max_new_tokens=24)
    batch = list(learner.buffer)
    assert len({ex.seq for ex in batch}) == 3 and len(batch) > 6
    # several examples of one sequence whose contexts part from the longest one before its end
    assert any(len(ex.ctx) < max(len(e.ctx) for e in batch if e.seq == ex.seq) for ex in batch)
    grads = {}
    for tree in (True, False):
        learner.tree = tree
        logits, _ = learner._draft_logits(batch)
        for p in learner.master:
            p.requires_grad_(True)
        loss = learner.losses(batch)["loss"]
        loss.backward()
        grads[tree] = (logits, float(loss.detach()), [p.grad.clone() for p in learner.master])
        for p in learner.master:
            p.grad = None
            p.requires_grad_(False)
    (lt, at, gt), (lf, af, gf) = grads[True], grads[False]
    for a, b in zip(lt, lf):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert at == pytest.approx(af, rel=1e-4)
    for a, b in zip(gt, gf):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
