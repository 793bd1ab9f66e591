"""Online adaptation of the drafter from the live stream (OmniDraft's hybrid distillation).

Data is on-policy: each speculative step records the drafter's context, its drafted tokens, and
the target's distributions at the proposed positions, taken from the verification pass already
computed (no extra target forward). Every ``interval`` prompts the runner calls :meth:`update`,
which runs AdamW on the buffer and clears it (no replay). The target is never touched.

Training runs on a copy of the drafter in ``train_dtype`` (fp32 by default) whose trainable
parameters are the optimiser's master weights; after each update they are cast back into the
inference drafter. With LoRA only the training copy carries adapters (peft); the served drafter
stays a plain model whose adapted linear weights are the merged ``W + scale * B @ A``, computed in
``train_dtype`` from the frozen base weights and cast once, so serving costs no extra matmuls and
repeated merges never accumulate rounding. Mini-batches are runs of up to ``batch_size``
consecutive steps of one prompt (their order shuffled), so each batch computes its shared context
once.
"""

from __future__ import annotations

import copy
import random
from dataclasses import asdict, dataclass, field

import torch

from omnidraft.core import kv
from omnidraft.drafting.direct_map import VocabBridge
from omnidraft.drafting.ngram_cache import Merged
from omnidraft.learn.losses import (
    DIVERGENCES,
    hybrid_loss,
    lifted_log_probs,
    ngram_nll,
    reverse_kl,
)
from omnidraft.state import (
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_rng_state,
)

HYBRID = ("kl_nll", "nll_only", "nll_nll", "kl_kl")  # OmniDraft's loss and its ablations
LOSSES = HYBRID + tuple(DIVERGENCES)  # + plain divergences on DM positions (OSD, DistillSpec)
POSITIONS = ("drafted", "rejected")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Example:
    """One speculative step, as training data.

    Attributes:
        seq: which generation (prompt) of the buffer it comes from.
        ctx: drafter context before drafting.
        drafts: drafter tokens behind the merged proposals.
        dm_pos: draft positions whose proposal is a directly mapped token.
        dm_logp: (len(dm_pos), C) target log-probabilities over the reachable target tokens.
        dm_top: per DM position, the column of the target's argmax, or -1 if the drafter cannot
            reach it (used by the ``nll_nll`` loss).
        ngrams: (start, end, target log-prob of the n-gram's token) of n-grams the target accepted.
        head: (start, end, label) per target proposal up to and including the first rejection, for
            an acceptance head trained jointly (:meth:`OnlineLearner.attach_head`); empty otherwise.
    """

    seq: int
    ctx: list[int]
    drafts: list[int]
    dm_pos: list[int]
    dm_logp: torch.Tensor
    dm_top: list[int] = field(default_factory=list)
    ngrams: list[tuple[int, int, float]] = field(default_factory=list)
    head: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def ng_pos(self) -> list[int]:
        return [j for s, e, _ in self.ngrams for j in range(s, e)]


def with_lora(model, rank: int, alpha: int | None = None, target_modules: list[str] | None = None,
              seed: int = 0):
    """Wrap a model with LoRA adapters (peft); the base weights stay frozen. The adapters'
    random initialisation draws from ``seed``, not from (or into) the global torch RNG."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=int(rank), lora_alpha=int(alpha or 2 * rank), lora_dropout=0.0,
                     target_modules=list(target_modules or ["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        wrapped = get_peft_model(model, cfg)
    for p in wrapped.parameters():
        p.requires_grad_(False)
    return wrapped.eval()


def lora_layers(peft_model) -> dict[str, torch.nn.Module]:
    """Module path in the unwrapped model -> its peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in peft_model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merge_lora_into(served: torch.nn.Module, peft_model) -> int:
    """Write ``base + delta`` of every LoRA layer of ``peft_model`` into the weight of the module at
    the same path in ``served`` (a plain model of the same architecture). Returns the count."""
    layers = lora_layers(peft_model)
    for name, mod in layers.items():
        w = served.get_submodule(name).weight
        delta = sum(mod.get_delta_weight(a) for a in mod.active_adapters)
        w.copy_((mod.base_layer.weight + delta).to(w.dtype))
    return len(layers)


def merge_lora_state(served: torch.nn.Module, tensors: dict[str, torch.Tensor], lora, dtype=torch.float32) -> int:
    """Serve a saved LoRA state (``param.<name>`` adapter tensors) frozen: merge it into ``served``."""
    from omnidraft.state import load_weights

    if any("lora_" in n for n, _ in served.named_parameters()):
        raise ValueError("merge_lora_state serves into a plain model; this one already carries LoRA adapters")
    wrapped = with_lora(copy.deepcopy(served).to(dtype), *lora)
    load_weights(wrapped, tensors)
    return merge_lora_into(served, wrapped)


def _bernoulli_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) from log-probabilities (the ``kl_kl`` loss's n-gram term)."""
    log_q, log_p = log_q.clamp(max=-1e-6), log_p.clamp(max=-1e-6)
    q = log_q.exp()
    return q * (log_q - log_p) + (1 - q) * (torch.log1p(-q) - torch.log1p(-log_p.exp()))


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

    def __init__(self, model, bridge: VocabBridge, *, lam: float = 0.2, loss: str = "kl_nll",
                 lr: float = 1e-4, weight_decay: float = 0.01, batch_size: int = 8,
                 steps_per_update: int = 1, seed: int = 0, context_grad: bool = False,
                 train_dtype: str = "float32", positions: str = "drafted", jsd_beta: float = 0.5,
                 tree: bool = True, lora=None):
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {positions!r}")
        self.positions, self.jsd_beta = positions, float(jsd_beta)
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if train_dtype not in DTYPES:
            raise ValueError(f"train_dtype must be one of {tuple(DTYPES)}, got {train_dtype!r}")
        self.model, self.lam, self.loss_name = model, float(lam), loss
        self.batch_size, self.steps_per_update = int(batch_size), int(steps_per_update)
        self.map_ids = torch.nonzero(bridge.draft_mask).squeeze(1)
        tgt = bridge.d2t[self.map_ids]
        self.cols = torch.unique(tgt)  # reachable target tokens, sorted
        self.map_cols = torch.searchsorted(self.cols, tgt)
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
        self.context_grad = bool(context_grad)
        # The examples of one sequence share a cached context: one tree-attention pass serves
        # them all (same logits as one pass per example, ~batch_size x fewer passes).
        self.tree = tree and kv.tree_mask_ok(self.train_model)
        self.n_updates = 0
        self._seq = 0
        self.head = None  # an adaptive.HeadLearner trained jointly: L_distill + L_head in one update

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

    def begin_sequence(self) -> None:
        """Called when the drafter starts a new prompt: later records share no context with earlier ones."""
        self._seq += 1

    def record(self, ctx: list[int], drafts: list[int], merged: list[Merged],
               target_logits: torch.Tensor, n_accepted: int,
               head: tuple[list[tuple[int, int]], list[float]] | None = None) -> None:
        """Store one step. ``target_logits`` row i is the target's distribution for proposal i.
        ``head``: (drafter-token span, label) per proposal up to the first rejection, kept when an
        acceptance head trains jointly."""
        if not merged:
            return
        head_spans = [(int(a), int(b), float(y)) for (a, b), y in zip(*head)] \
            if head is not None and self._head_on else []
        dm_rows, dm_pos, ng_rows = [], [], []
        for i, m in enumerate(merged):
            if self.positions == "rejected" and i != n_accepted:
                continue  # OSD: only the first rejected proposal (none when all were accepted)
            if m.is_ngram:
                if i < n_accepted:
                    ng_rows.append(i)
            else:
                dm_rows.append(i)
                dm_pos.append(m.start)
        if not dm_rows and not ng_rows and not head_spans:
            return
        # Normalise only the rows kept (a full-vocabulary log-softmax per row is the costly part).
        ng_logp = torch.log_softmax(target_logits[ng_rows].float(), -1) if ng_rows else None
        ngrams = [(merged[i].start, merged[i].end, float(ng_logp[r, merged[i].target_id]))
                  for r, i in enumerate(ng_rows)]
        dm_all = torch.log_softmax(target_logits[dm_rows].float(), -1)
        cols = self.cols.to(target_logits.device)
        logp = dm_all[:, cols]
        top = dm_all.argmax(-1)
        col = torch.searchsorted(cols, top).clamp(max=len(cols) - 1)
        dm_top = torch.where(cols[col] == top, col, -1).tolist()
        self.buffer.append(Example(self._seq, list(ctx), list(drafts), dm_pos,
                                   logp.to(torch.float16).cpu(), dm_top, ngrams, head_spans))

    # -- loss ------------------------------------------------------------------------------
    def _draft_logits(self, examples: list[Example]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Training-model logits (n_drafts, V) at each example's drafted positions (grad w.r.t. the
        drafts only, unless context_grad), and the last-layer hidden states there (n_drafts, H)
        for examples that carry head labels (None for the others). Examples of one sequence share
        one no-grad context pass."""
        m, dev = self.train_model, self.train_model.device
        out: list[torch.Tensor | None] = [None] * len(examples)
        hid: list[torch.Tensor | None] = [None] * len(examples)
        want = self._head_on and any(ex.head for ex in examples)
        if self.context_grad:
            for i, ex in enumerate(examples):
                ids = torch.tensor([ex.ctx + ex.drafts[:-1]], device=dev)
                o = m(input_ids=ids, logits_to_keep=len(ex.drafts), output_hidden_states=want)
                out[i] = o.logits[0].float()
                if want:
                    hid[i] = o.hidden_states[-1][0, -len(ex.drafts):].float()
            return out, hid
        groups: dict[int, list[int]] = {}
        for i, ex in enumerate(examples):
            groups.setdefault(ex.seq, []).append(i)
        for idx in groups.values():
            base = max((examples[i].ctx for i in idx), key=len)
            cache = kv.new_cache(m)
            if len(base) > 1:
                with torch.no_grad():
                    m(input_ids=torch.tensor([base[:-1]], device=dev), cache=cache, logits_to_keep=1)
            branches = []
            for i in idx:
                ex = examples[i]
                n = 0
                lim = min(len(ex.ctx) - 1, len(base) - 1)
                while n < lim and ex.ctx[n] == base[n]:
                    n += 1
                branches.append((n, ex.ctx[n:] + ex.drafts[:-1]))
            if self.tree:  # every example of the sequence in one pass (tree attention)
                res = kv.forward_branches(m, cache, branches, hidden=want)
                lgs, hds = res if want else (res, [None] * len(idx))
                for i, lg, hd in zip(idx, lgs, hds):
                    n_d = len(examples[i].drafts)
                    out[i] = lg[-n_d:].float()
                    hid[i] = hd[-n_d:].float() if hd is not None else None
                continue
            for i, (n, b) in zip(idx, branches):
                c = kv.prefix_copy(cache, n, m) if len(base) > 1 else kv.new_cache(m)
                ids = torch.tensor([b], device=dev)
                n_d = len(examples[i].drafts)
                o = m(input_ids=ids, cache=c, logits_to_keep=n_d, output_hidden_states=want)
                out[i] = o.logits[0].float()
                if want:
                    hid[i] = o.hidden_states[-1][0, -n_d:].float()
        return out, hid

    def losses(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        """Hybrid loss over examples (differentiable w.r.t. the training copy's master weights),
        plus the jointly trained head's weighted BCE (``loss_head``) when a learning head is
        attached: ``loss`` (what is minimised) = ``loss_distill`` + ``loss_head``."""
        dm_terms, ng_terms = [], []
        dev = self.train_model.device
        map_ids, map_cols = self.map_ids.to(dev), self.map_cols.to(dev)
        logits_all, hidden_all = self._draft_logits(examples)
        head_items = [(h[a:b], y) for ex, h in zip(examples, hidden_all) if h is not None for a, b, y in ex.head]
        for ex, logits in zip(examples, logits_all):
            if self.loss_name in DIVERGENCES:  # one divergence on DM positions, no n-gram term
                if ex.dm_pos:
                    lq = lifted_log_probs(logits[ex.dm_pos], map_ids, map_cols, len(self.cols))
                    lp = torch.log_softmax(ex.dm_logp.to(dev).float(), -1)  # renormalised over reachable tokens
                    dm_terms.append(DIVERGENCES[self.loss_name](lp, lq, beta=self.jsd_beta))
                continue
            if ex.dm_pos and self.loss_name != "nll_only":
                lq = lifted_log_probs(logits[ex.dm_pos], map_ids, map_cols, len(self.cols))
                if self.loss_name == "nll_nll":
                    rows = [r for r, c in enumerate(ex.dm_top) if c >= 0]
                    if rows:
                        dm_terms.append(-lq[rows, torch.tensor([ex.dm_top[r] for r in rows], device=dev)])
                else:
                    dm_terms.append(reverse_kl(lq, ex.dm_logp.to(dev).float()))
            if ex.ngrams:
                sub = torch.tensor([ex.drafts[j] for j in ex.ng_pos], device=dev)
                nll = ngram_nll(logits[ex.ng_pos], sub)
                if self.loss_name == "kl_kl":
                    sizes = [e - s for s, e, _ in ex.ngrams]
                    log_q = -torch.stack([x.sum() for x in torch.split(nll, sizes)])
                    log_p = torch.tensor([lp for _, _, lp in ex.ngrams], device=dev)
                    ng_terms.append(_bernoulli_kl(log_q, log_p))
                else:
                    ng_terms.append(nll)
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, device=dev)  # noqa: E731
        lam = 1.0 if self.loss_name == "nll_only" else self.lam
        out = hybrid_loss(cat(dm_terms), cat(ng_terms), lam)
        out["loss_distill"] = out["loss"]
        if head_items:
            out["loss_head"] = self.head.loss(head_items)
            out["loss"] = out["loss"] + out["loss_head"]
        return out

    # -- update ----------------------------------------------------------------------------
    def _batches(self) -> list[list[int]]:
        """Runs of <= batch_size consecutive examples of one sequence, in shuffled order."""
        out: list[list[int]] = []
        for i, ex in enumerate(self.buffer):
            if out and len(out[-1]) < self.batch_size and self.buffer[out[-1][-1]].seq == ex.seq:
                out[-1].append(i)
            else:
                out.append([i])
        self.rng.shuffle(out)
        return out

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
        n, n_examples = 0, len(self.buffer)
        plan = [self._batches() for _ in range(self.steps_per_update)]
        bar = tqdm(total=sum(map(len, plan)), desc="adapt", unit="batch", leave=False, disable=not progress)
        try:
            for batches in plan:
                for b in batches:
                    bar.update(1)
                    out = self.losses([self.buffer[i] for i in b])
                    if out["loss"].requires_grad:
                        out["loss"].backward()
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
        out = {k: v / max(1, n) for k, v in stats.items()} | {"adapt/n_examples": n_examples, "adapt/n_batches": n}
        if head is not None and n_head:
            head.n_updates += 1
            out |= {"head/loss": head_loss / n_head, "head/n_updates": head.n_updates}
        return out

    # -- state -----------------------------------------------------------------------------
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
        self.buffer = [Example(**{**b, "ngrams": [tuple(x) for x in b["ngrams"]],
                                  "head": [tuple(x) for x in b.get("head", [])]},
                               dm_logp=tensors[f"buffer.{j}.dm_logp"]) for j, b in enumerate(meta["buffer"])]
