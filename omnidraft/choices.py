"""The allowed values of every enumerated setting, in one place.

The config schema (:mod:`omnidraft.config`) checks the YAML against these tuples, and the library
classes that take the same settings as arguments (:class:`omnidraft.learn.online.OnlineLearner`,
:class:`omnidraft.learn.acceptance_head.HeadLearner`, the n-gram drafter) check their arguments
against them, so adding a value is one edit here. This module imports nothing from omnidraft (nor
torch, hydra or omegaconf): every layer may import it.
"""

from __future__ import annotations

# method.engine: this package's decode loop | transformers' assisted generation
ENGINES = ("omnidraft", "hf_assisted")
# engine: verify with the target model | replay the target's recorded greedy trajectory (omnidraft trace)
RUN_ENGINES = ("live", "replay")
# protocol: one online stream over the task | adapt on a train slice, evaluate frozen on the test prompts
PROTOCOLS = ("stream", "train_test")
# replay.rows: the target rows of learning observers from two batched forwards | live's forwards replayed
REPLAY_ROWS = ("batched", "stepwise")
# method.drafts_with: a drafter LM | model-free lookup in the context (PLD) | no drafter (ar, hf_ar)
DRAFTS_WITH = ("model", "lookup", "none")
# method.verify: greedy, exact | OmniDraft's approximate q' product rule for n-gram proposals
VERIFY_RULES = ("lossless", "paper")

# method.adapt.loss: OmniDraft's hybrid loss and its ablations, then plain divergences on directly
# mapped positions (OSD, DistillSpec; :data:`omnidraft.learn.losses.DIVERGENCES` implements them)
HYBRID_LOSSES = ("kl_nll", "nll_only", "nll_nll", "kl_kl")
DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")
LOSSES = HYBRID_LOSSES + DIVERGENCES
# method.adapt.positions: every directly mapped proposal | the first rejected one per step (OSD)
POSITIONS = ("drafted", "rejected")
# method.adapt.train_dtype, distill.train_dtype: dtype of the training copy / master weights
TRAIN_DTYPES = ("float32", "bfloat16", "float16")

# method.draft_length.*
LENGTH_POLICIES = ("fixed", "heuristic", "head", "cost", "confidence")
HEAD_MODES = ("joint", "interleaved")
HEAD_LABELS = ("verify", "t1")

# method.hf.num_assistant_tokens_schedule (transformers' names)
HF_SCHEDULES = ("constant", "heuristic", "heuristic_transient")

# distill.data: the drafter's own responses (on-policy) | the target's
DISTILL_DATA = ("drafter", "target")
