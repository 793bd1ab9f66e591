"""Shared fixtures: tiny models of real architectures paired with REAL, different tokenizers.

Tokenizers come from the vocabulary-only GGUFs in the llama-cpp-python sdist (fetched once into the
omnidraft cache). Weights are deterministic. An *aligned* drafter copies the target's transformer
and maps its embedding / output rows through the direct vocabulary map, so that drafter and target
agree where their tokenisations agree: the acceptance path is exercised, not only rejection.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from omnidraft.config import CONF_DIR  # noqa: E402,F401  (tests import it from here)
from omnidraft.data.artifacts import default_cache_dir
from omnidraft.data.models import build_tiny, fixed_init
from omnidraft.drafting.direct_map import build_bridge

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
            max_position_embeddings=2048, init_std=0.5)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Explain why the sky is blue in simple words.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
    "Translate to French: good morning, how are you?",
    "Stamps, flakes and unbelievable counterexamples.",
    "1 + 1 = 2, 2 + 2 = 4, 3 + 3 =",
    "Once upon a time, in a land far away, there lived a dragon",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "The mitochondria is the powerhouse of the cell.",
    "List: apples, bananas, cherries, dates, elderberries",
    "Q: What is the capital of Japan?\nA:",
    "for (int i = 0; i < n; i++) { sum += a[i]; }",
    "Ünïcödé text — with dashes… and emojis 🚀✨",
    "James writes a 3-page letter to 2 different friends twice a week.",
    "<html><body><h1>Hello</h1></body></html>",
    "In 1492, Columbus sailed the ocean blue.",
    "   leading spaces and\ttabs\nnew lines",
    "A robe takes 2 bolts of blue fiber and half that much white fiber.",
    "The derivative of x^2 is 2x; the integral of 2x is x^2 + C.",
]


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


def tiny(arch: str, tokenizer: str, seed: int, cache_dir: Path, dtype=torch.float32):
    spec = dict(TINY, arch=arch, tokenizer=tokenizer, init_seed=seed)
    model, tok = build_tiny(spec, cache_dir, dtype)
    return model.eval(), tok


def aligned_drafter(target, bridge, draft_vocab_size: int, seed: int = 7, noise: float = 0.0):
    """A drafter with the target's architecture whose vocabulary rows come through the direct map."""
    cfg = copy.deepcopy(target.config)
    cfg.vocab_size = draft_vocab_size
    cfg.pad_token_id = cfg.bos_token_id = cfg.eos_token_id = None
    d = type(target)(cfg).eval()
    fixed_init(d, seed, 0.5)
    sd_t = target.state_dict()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                mapped = bridge.draft_mask.nonzero().squeeze(1)
                p[mapped] = sd_t[name][bridge.d2t[mapped]].to(p.dtype)
            else:
                p.copy_(sd_t[name])
            if noise:
                g = torch.Generator().manual_seed(seed)
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    for p in d.parameters():
        p.requires_grad_(False)
    return d.to(next(target.parameters()).dtype)


@pytest.fixture(scope="session")
def qwen_tiny(cache_dir):
    return tiny("qwen2", "qwen2", 1, cache_dir)


@pytest.fixture(scope="session")
def llama3_tiny(cache_dir):
    return tiny("llama", "llama-bpe", 3, cache_dir)


@pytest.fixture(scope="session")
def llama2_tok(cache_dir):
    from omnidraft.data.models import load_vocab_tokenizer

    return load_vocab_tokenizer("llama-spm", cache_dir)


def cross_pair(target, ttok, dtok, cache_dir):
    """(target, target_tok, drafter, drafter_tok, bridge) for a cross-vocabulary pair.

    The target's output rows for tokens the drafter cannot spell are damped (x0.3), so its greedy
    text is mostly made of directly mapped tokens, as a real target's mostly is.
    """
    bridge = build_bridge(dtok, ttok, cache_dir)
    target = copy.deepcopy(target)
    with torch.no_grad():
        covered = torch.zeros(target.config.vocab_size, dtype=torch.bool)
        covered[bridge.d2t[bridge.draft_mask]] = True
        target.get_output_embeddings().weight[~covered] *= 0.3
    return target, ttok, aligned_drafter(target, bridge, len(dtok)), dtok, bridge


@pytest.fixture(scope="session")
def pair_llama2_qwen(qwen_tiny, llama2_tok, cache_dir):
    """Llama-2 tokenizer (the paper's drafter) drafting for the Qwen2 tokenizer."""
    return cross_pair(*qwen_tiny, llama2_tok, cache_dir)


@pytest.fixture(scope="session")
def pair_llama2_llama3(llama3_tiny, llama2_tok, cache_dir):
    """Llama-2 tokenizer drafting for the Llama-3 tokenizer."""
    return cross_pair(*llama3_tiny, llama2_tok, cache_dir)


def compose_run(tmp: Path, name: str, base: list[str], *over: str, config: str = "config"):
    """A run's config as the CLI composes it: ``base`` then ``over`` (recorded as the run's
    ``overrides``), run directory ``tmp/name``, results under ``tmp/results``."""
    import json

    from hydra import compose, initialize_config_dir

    from omnidraft.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        over = [*base, f"paths.results_dir={tmp}/results", *over]
        return compose(config, overrides=[f"run_dir={tmp}/{name}", *over, f"overrides={json.dumps(over)}"])


def metrics_rows(run_dir: Path) -> list[dict]:
    """A run directory's ``metrics.jsonl`` rows, as written."""
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def eos_of(tok) -> set[int]:
    return {tok.eos_token_id} if tok.eos_token_id is not None else set()


def one_error_line(proc, *needles):
    """A CLI run that failed with exactly one ``omnidraft: error:`` line (containing ``needles``) and no traceback."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("omnidraft: error:")]
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n 2``) each worker computes on one thread: the workers
    already share the cores, and tiny models gain nothing from a second thread."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
