"""KV rollback: logits after crop + re-feed equal logits of a fresh forward."""

from __future__ import annotations

import torch

from omnidraft.core import kv


def test_crop_then_refeed_equals_fresh_forward(qwen_tiny):
    model, tok = qwen_tiny
    ids = tok.encode("The quick brown fox jumps over the lazy dog and keeps running far away")
    assert len(ids) > 12
    cache = kv.new_cache(model)
    kv.forward(model, ids[:8], cache)
    kv.forward(model, [11, 12, 13, 14], cache)  # a rejected draft
    assert kv.cache_len(cache) == 12
    kv.crop_to(cache, 9)
    assert kv.cache_len(cache) == 9
    got = kv.forward(model, ids[9:12], cache)  # continue after ids[:8] + [11]
    fresh = kv.forward(model, ids[:8] + [11] + ids[9:12], kv.new_cache(model))[-3:]
    torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)


def test_crop_rejects_growing(qwen_tiny):
    model, tok = qwen_tiny
    cache = kv.new_cache(model)
    kv.forward(model, [1, 2, 3], cache)
    try:
        kv.crop_to(cache, 5)
    except ValueError:
        return
    raise AssertionError("crop_to beyond the cached length must raise")
