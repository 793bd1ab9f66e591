"""Online adaptation of the drafter from the live stream (OmniDraft's hybrid distillation).

The :class:`OnlineLearner` is an observer of the decode loop: every step's feedback becomes a
training example (:mod:`omnidraft.learn.buffer`: the drafter's context, its drafted tokens, the
target's distributions at the proposed positions, taken from the verification pass already computed,
no extra target forward). Every ``interval`` prompts the session calls :meth:`update`, which runs
AdamW on the buffer (:mod:`omnidraft.learn.training` computes the drafter's logits, a loss from
:data:`omnidraft.learn.losses.LOSSES` scores them) and clears it (no replay). The target is never
touched.

Training runs on a copy of the drafter in ``train_dtype`` (fp32 by default) whose trainable
parameters are the optimiser's master weights; after each update they are cast back into the
inference drafter. With LoRA only the training copy carries adapters (:mod:`omnidraft.learn.lora`);
the served drafter stays a plain model with merged weights.
"""

from __future__ import annotations

import copy
import random
import uuid
from dataclasses import asdict

import torch

from omnidraft.choices import LOSSES as LOSS_NAMES
from omnidraft.choices import POSITIONS, TRAIN_DTYPES
from omnidraft.core import kv
from omnidraft.core.feedback import StepFeedback, require_rows
from omnidraft.drafting.direct_map import VocabBridge
from omnidraft.learn.acceptance_head import step_labels
from omnidraft.learn.buffer import Example, batches, make_example
from omnidraft.learn.lora import merge_lora_into, with_lora
from omnidraft.learn.losses import LOSSES, hybrid_loss, lifted_log_probs, ngram_nll
from omnidraft.learn.training import draft_logits
from omnidraft.state import finite_each, learner_part, load_optimizer_state, optimizer_state, rng_state, set_rng_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OnlineLearner:
    """Buffer + optimiser for the drafter.

    Args:
        model: the inference drafter; its trainable weights are overwritten after each step.
        bridge: the direct map drafter -> target.
        lam: weight of the n-gram term (paper: 0.2); 0 gives ``L_DM`` only.
        loss: 'kl_nll' (paper's main: reverse KL on DM positions + lam * NLL on n-gram
            sub-tokens), 'nll_only' (n-gram NLL only), 'nll_nll' (NLL of the target's argmax at
            DM positions + lam * n-gram NLL), 'kl_kl' (reverse KL on DM + lam * approximate KL on
            n-grams: the Bernoulli KL between the drafter's product probability of the accepted
            n-gram token and the target's probability of it).
        context_grad: back-propagate through the whole context (exact, ~tokens x slower) or only
            through the <= k drafted positions, the context's keys/values computed without grad
            (default; project choice, the paper is silent).
        train_dtype: dtype of the training copy and master weights ('float32' default).
        positions: 'drafted' (every directly mapped proposal of a step) or 'rejected' (only the
            first rejected proposal of each step, where the target's distribution is conditioned
            on accepted text: Online Speculative Decoding's data).
        jsd_beta: beta of the 'jsd' divergence.
        tree: batch the examples of one sequence into one forward pass with a tree attention
            mask (Llama/Qwen2-style models; others always take one pass per example).
        lora: None (full fine-tuning) or (rank, alpha, target_modules): LoRA adapters on the
            training copy only; ``model`` must be a plain model, served with merged weights.

    Losses 'fkl', 'rkl', 'jsd', 'tvd' are one divergence between the target's distribution
    (renormalised over the target tokens the drafter can reach) and the drafter's lifted one, at
    directly mapped positions, with no n-gram term: OSD uses 'fkl' with positions='rejected',
    DistillSpec any of them offline.
    """

    needs_rows = True  # learns from the verification rows (omnidraft.core.feedback.Observer)

    def __init__(self, model, bridge: VocabBridge, *, lam: float = 0.2, loss: str = "kl_nll",
                 lr: float = 1e-4, weight_decay: float = 0.01, batch_size: int = 8,
                 steps_per_update: int = 1, seed: int = 0, context_grad: bool = False,
                 train_dtype: str = "float32", positions: str = "drafted", jsd_beta: float = 0.5,
                 tree: bool = True, lora=None):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.positions, self.jsd_beta = positions, float(jsd_beta)
        if loss not in LOSS_NAMES:
            raise ValueError(f"loss must be one of {LOSS_NAMES}, got {loss!r}")
        if train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train_dtype must be one of {TRAIN_DTYPES}, got {train_dtype!r}")
        self.model, self.lam, self.loss_name = model, float(lam), loss
        self.batch_size, self.steps_per_update = int(batch_size), int(steps_per_update)
        self.use_bridge(bridge)
        self.buffer: list[Example] = []
        self.rng = random.Random(seed)
        if any("lora_" in n for n, _ in model.named_parameters()):
            raise ValueError("OnlineLearner takes the plain drafter; pass lora=(rank, alpha, modules) "
                             "for LoRA (the adapters live on the training copy, served merged)")
        self.lora = tuple(lora) if lora else None
        self.train_model = copy.deepcopy(model).to(DTYPES[train_dtype])
        if self.lora:  # only the adapter weights train
            self.train_model = with_lora(self.train_model, *self.lora, seed=seed)
        self.train_model.eval()
        t_named = dict(self.train_model.named_parameters())
        for p in t_named.values():
            p.requires_grad_(False)
        self.names = [n for n in t_named if "lora_" in n] if self.lora else list(t_named)
        self.master = [t_named[n] for n in self.names]
        named = dict(model.named_parameters())
        self.params = [] if self.lora else [named[n] for n in self.names]
        # fused AdamW: one kernel over all tensors (~7x faster than foreach for a 135M drafter on CPU)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in self.master)
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay,
                                     fused=fused or None)
        # what a target starts with (its part: load_target_state): the adapters as initialised, no moments
        self._fresh_adapters = {f"param.{n}": m.detach().clone() for n, m in zip(self.names, self.master)} \
            if self.lora else {}
        self._fresh_opt = copy.deepcopy(self.opt.state_dict())
        self.context_grad = bool(context_grad)
        # The examples of one sequence share a cached context: one tree-attention pass serves
        # them all (same logits as one pass per example, ~batch_size x fewer passes).
        self.tree = tree and kv.tree_mask_ok(self.train_model)
        self.n_updates = 0
        self._seq = 0
        # which master weights + moments these are (omnidraft.state.SavedState.weights_version): a
        # checkpoint between two updates reuses the file the last one wrote
        self._weights_nonce = uuid.uuid4().hex[:12]
        self._weights_gen = 0
        self.head = None  # an acceptance_head.HeadLearner trained jointly: L_distill + L_head in one update

    def use_bridge(self, bridge: VocabBridge) -> None:
        """Learn for the target of ``bridge`` (the direct map drafter -> that target): the target
        columns the examples' distributions live in. The buffer must be that target's
        (:meth:`load_target_state`)."""
        self.map_ids = torch.nonzero(bridge.draft_mask).squeeze(1)
        tgt = bridge.d2t[self.map_ids]
        self.cols = torch.unique(tgt)  # reachable target tokens, sorted
        self.map_cols = torch.searchsorted(self.cols, tgt)

    def attach_head(self, head_learner) -> None:
        """Train ``head_learner``'s acceptance head jointly with the drafter (the paper's 'joint'
        variant): each mini-batch's loss is L_distill + L_head, with the head's weighted BCE computed
        on the training copy's hidden states at the drafted positions, so its gradient reaches the
        drafter (or its LoRA adapters) as well as the head; both optimisers step together."""
        self.head = head_learner
        head_learner.in_learner = True
        head_learner.buffer.clear()  # its own buffer is unused from now on

    @property
    def _head_on(self) -> bool:
        """A jointly trained head that is learning (a frozen one takes no part in the loss)."""
        return self.head is not None and self.head.learn

    def start(self, prompt_ids: list[int]) -> None:
        """A new prompt begins (observer of the decode loop)."""
        self.begin_sequence()

    def begin_sequence(self) -> None:
        """Later records share no context with earlier ones."""
        self._seq += 1

    def observe(self, fb: StepFeedback) -> None:
        """Record one step (observer of the decode loop). A jointly trained head's labels are
        computed from the same feedback (:func:`omnidraft.learn.acceptance_head.step_labels`)."""
        require_rows(fb, "online distillation")
        prop = fb.proposal
        head = step_labels(fb, self.head.label) if self._head_on else None
        self.record(prop.context, prop.drafts, prop.spans, fb.rows, fb.n_accepted, head=head)

    def record(self, ctx: list[int], drafts: list[int], merged, target_logits: torch.Tensor, n_accepted: int,
               head: tuple[list[tuple[int, int]], list[float]] | None = None) -> None:
        """Store one step. ``merged``: the proposals' spans; ``target_logits`` row i is the target's
        distribution for proposal i. ``head``: (drafter-token span, label) per proposal up to the
        first rejection, kept when an acceptance head trains jointly."""
        head_spans = [(int(a), int(b), float(y)) for (a, b), y in zip(*head)] \
            if head is not None and self._head_on else []
        ex = make_example(self._seq, ctx, drafts, merged, target_logits, n_accepted, self.cols, self.positions,
                          head_spans)
        if ex is not None:
            self.buffer.append(ex)

    # -- loss ------------------------------------------------------------------------------
    def _draft_logits(self, examples: list[Example]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The training copy's logits (and, for a learning head, hidden states) at the drafted positions."""
        want = self._head_on and any(ex.head for ex in examples)
        return draft_logits(self.train_model, examples, context_grad=self.context_grad, tree=self.tree, hidden=want)

    def losses(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """The configured loss over examples (differentiable w.r.t. the training copy's master
        weights), plus the jointly trained head's weighted BCE (``loss_head``) when a learning head is
        attached: ``loss`` (what is minimised) = ``loss_distill`` + ``loss_head``."""
        spec = LOSSES[self.loss_name]
        dm_terms, ng_terms = [], []
        dev = self.train_model.device
        map_ids, map_cols = self.map_ids.to(dev), self.map_cols.to(dev)
        logits_all, hidden_all = self._draft_logits(examples)
        head_items = [(h[a:b], y) for ex, h in zip(examples, hidden_all) if h is not None for a, b, y in ex.head]
        for ex, logits in zip(examples, logits_all):
            if spec.dm is not None and ex.dm_pos:
                lq = lifted_log_probs(logits[ex.dm_pos], map_ids, map_cols, len(self.cols))
                term = spec.dm(lq, ex, self.jsd_beta)
                if term is not None:
                    dm_terms.append(term)
            if spec.ngram is not None and ex.ngrams:
                sub = torch.tensor([ex.drafts[j] for j in ex.ng_pos], device=dev)
                ng_terms.append(spec.ngram(ngram_nll(logits[ex.ng_pos], sub), ex))
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, device=dev)  # noqa: E731
        out = hybrid_loss(cat(dm_terms), cat(ng_terms), spec.lam if spec.lam is not None else self.lam)
        out["loss_distill"] = out["loss"]
        if head_items:
            out["loss_head"] = self.head.loss(head_items)
            out["loss"] = out["loss"] + out["loss_head"]
        return out

    # -- update ----------------------------------------------------------------------------
    @torch.no_grad()
    def _sync_weights(self) -> None:
        if self.lora:
            merge_lora_into(self.model, self.train_model)
            return
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.dtype))

    def update(self, progress: bool = True) -> dict[str, float]:
        """AdamW steps over the buffer in mini-batches, then clear it. Returns mean losses."""
        from tqdm.auto import tqdm

        if not self.buffer:
            return {}
        self.train_model.train()
        for p in self.master:
            p.requires_grad_(True)
        head = self.head if self._head_on else None
        if head is not None:
            head.head.train()
        stats = {"adapt/loss": 0.0, "adapt/loss_dm": 0.0, "adapt/loss_ngram": 0.0}
        head_loss, n_head = 0.0, 0
        n, n_examples, skipped, reverted = 0, len(self.buffer), 0, False
        params = [*self.master, *(head.head.parameters() if head is not None else ())]
        last_good = [p.detach().clone() for p in params]  # served again if this update diverges
        plan = [batches(self.buffer, self.batch_size, self.rng) for _ in range(self.steps_per_update)]
        bar = tqdm(total=sum(map(len, plan)), desc="adapt", unit="batch", leave=False, disable=not progress)
        try:
            for epoch in plan:
                for b in epoch:
                    bar.update(1)
                    out = self.losses([self.buffer[i] for i in b])
                    if not bool(torch.isfinite(out["loss"].detach())):
                        skipped += 1  # a NaN / inf loss teaches nothing: no step on this mini-batch
                        continue
                    if out["loss"].requires_grad:
                        out["loss"].backward()
                        if not _all_finite([p.grad for p in params if p.grad is not None]):
                            skipped += 1
                            self.opt.zero_grad(set_to_none=True)
                            if head is not None:
                                head.opt.zero_grad(set_to_none=True)
                            continue
                        self.opt.step()
                        self.opt.zero_grad(set_to_none=True)
                        if head is not None:
                            head.opt.step()
                            head.opt.zero_grad(set_to_none=True)
                    if "loss_head" in out:
                        head_loss += float(out["loss_head"].detach())
                        n_head += 1
                    for k, key in (("loss_distill", "adapt/loss"), ("loss_dm", "adapt/loss_dm"),
                                   ("loss_ngram", "adapt/loss_ngram")):
                        stats[key] += float(out[k].detach())
                    n += 1
            if not _all_finite(params):  # e.g. a learning rate far too large
                reverted = True
                with torch.no_grad():
                    for p, good in zip(params, last_good):
                        p.copy_(good)
        finally:
            bar.close()
            self.opt.zero_grad(set_to_none=True)
            for p in self.master:
                p.requires_grad_(False)
            self.train_model.eval()
            if head is not None:
                head.opt.zero_grad(set_to_none=True)
                head.head.eval()
            self._sync_weights()
            self.buffer.clear()
        self.n_updates += 1
        self._weights_gen += 1
        out = {k: v / max(1, n) for k, v in stats.items()} | {"adapt/n_examples": n_examples, "adapt/n_batches": n}
        if skipped or reverted:
            import warnings

            out |= {"adapt/skipped_batches": skipped, "adapt/reverted": int(reverted)}
            what = [f"{skipped} mini-batch(es) with a non-finite loss or gradient skipped"] if skipped else []
            what += ["the weights diverged, so the last good ones are served"] if reverted else []
            warnings.warn(f"online update {self.n_updates}: {'; '.join(what)} (lower method.adapt.lr?)", stacklevel=2)
        if head is not None and n_head:
            head.n_updates += 1
            out |= {"head/loss": head_loss / n_head, "head/n_updates": head.n_updates}
        return out

    # -- state -----------------------------------------------------------------------------
    @property
    def weights_version(self) -> str:
        """Changes whenever the master weights or their AdamW moments may have (an update, a load)."""
        return f"{self._weights_nonce}:{self._weights_gen}"

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors for safetensors, JSON-able metadata): master weights by parameter name,
        AdamW state, the unflushed buffer, RNG state and counters."""
        tensors = {f"param.{n}": m.detach().contiguous() for n, m in zip(self.names, self.master)}
        opt_tensors, opt_meta = optimizer_state(self.opt, "opt")
        tensors.update(opt_tensors)
        for j, ex in enumerate(self.buffer):
            tensors[f"buffer.{j}.dm_logp"] = ex.dm_logp.contiguous()
        buf = [{k: v for k, v in asdict(ex).items() if k != "dm_logp"} for ex in self.buffer]
        meta = {"names": self.names, **opt_meta, "rng": rng_state(self.rng), "n_updates": self.n_updates, "seq": self._seq,
                "buffer": buf, "lora": any("lora_" in n for n in self.names)}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, weights_only: bool = False) -> None:
        """Restore :meth:`state_dict`. ``weights_only``: the weights, not the optimiser/buffer/RNG
        (a drafter adapted on one stream starting another)."""
        self._weights_gen += 1
        missing = [n for n in self.names if f"param.{n}" not in tensors]
        if missing:
            raise ValueError(f"saved state lacks {len(missing)} trainable parameter(s) of this drafter, "
                             f"e.g. {missing[0]!r} (LoRA state into a full fine-tune, or another model?)")
        with torch.no_grad():
            for n, m in zip(self.names, self.master):
                m.copy_(tensors[f"param.{n}"].to(m.dtype))
        self._sync_weights()
        if weights_only:
            return
        load_optimizer_state(self.opt, tensors, meta, "opt")
        set_rng_state(self.rng, meta["rng"])
        self.n_updates, self._seq = int(meta["n_updates"]), int(meta["seq"])
        self.buffer = _buffer_of(tensors, meta)

    def target_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The current target's part of :meth:`state_dict` (:func:`omnidraft.state.learner_part`),
        copied: the unflushed examples and, with LoRA, the adapters and their AdamW moments. Full
        fine-tuning's weights and moments are the drafter's, shared by every target."""
        tensors, meta = learner_part(*self.state_dict(), lora=bool(self.lora))
        return {k: v.clone() for k, v in tensors.items()}, copy.deepcopy(meta)

    def load_target_state(self, tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> None:
        """Make a target's part (:meth:`target_state`, or a saved state's) the current one. Missing
        pieces start fresh: no tensors, the adapters as initialised; no moments, none; no
        examples, an empty buffer. With LoRA the served drafter gets the adapters merged."""
        tensors, meta = tensors or {}, meta or {}
        self._weights_gen += 1
        if self.lora:
            given = [k for k in tensors if k.startswith("param.")]
            missing = [n for n in self.names if f"param.{n}" not in tensors]
            if given and missing:
                raise ValueError(f"saved state lacks {len(missing)} trainable parameter(s) of this drafter, "
                                 f"e.g. {missing[0]!r} (a full fine-tune's state into LoRA, or another rank?)")
            src = tensors if given else self._fresh_adapters
            with torch.no_grad():
                for n, m in zip(self.names, self.master):
                    m.copy_(src[f"param.{n}"].to(m.dtype))
            if "opt_state" in meta:
                load_optimizer_state(self.opt, tensors, meta, "opt")
            else:
                self.opt.load_state_dict(copy.deepcopy(self._fresh_opt))
            self._sync_weights()
        self.buffer = _buffer_of(tensors, meta)


def _buffer_of(tensors: dict[str, torch.Tensor], meta: dict) -> list[Example]:
    """The unflushed examples of a saved learner state (none when it holds none)."""
    return [Example(**{**b, "ngrams": [tuple(x) for x in b["ngrams"]], "head": [tuple(x) for x in b.get("head", [])]},
                    dm_logp=tensors[f"buffer.{j}.dm_logp"]) for j, b in enumerate(meta.get("buffer", []))]


def _all_finite(tensors) -> bool:
    """Whether every element of every tensor is finite, in one host sync for all of them
    (:func:`omnidraft.state.finite_each`, which every mini-batch of an update calls on the gradients)."""
    return all(finite_each(list(tensors)))
