"""The online acceptance-prediction head (SpecDec++, after METHOD.md section 3) and its learner.

:class:`AcceptanceHead` maps the drafter's last hidden state at a drafted token to the logit of
P(accept | everything before accepted); :class:`omnidraft.learn.draft_length.HeadPolicy` stops
drafting on it. :class:`HeadLearner` trains it online from each step's verification.

Cross-vocabulary (beyond the paper): the head runs per DRAFTER token; a merged n-gram's acceptance
prediction is the PRODUCT of its sub-tokens' predictions (the same product rule as its draft
probability), which is also what the head is trained against (one BCE term per merged proposal on
that product).

Training: soft labels min(1, p(y_i) / q(y_i)) from the verification pass already computed, for
proposals up to and including the first rejection. ``label='verify'`` (default) takes p and q at the
verification temperature, so under greedy verification the label is the T -> 0 limit of that ratio:
1 when y_i is the target's argmax (accepted), else 0; ``label='t1'`` takes them at T=1 whatever the
verification does. Weighted BCE with the mismatch (label 0) term weighted ``mismatch_weight``
(SpecDec++: ~6). ``joint``: one update per distillation interval on the examples collected since;
``interleaved``: an update every ``every`` prompts on a FIFO replay buffer of bounded size.
"""

from __future__ import annotations

import random
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from omnidraft.choices import HEAD_LABELS, HEAD_MODES
from omnidraft.core.feedback import StepFeedback, require_rows
from omnidraft.state import load_optimizer_state, optimizer_state, rng_state, set_rng_state


def label_temperature(label: str, temperature: float) -> float:
    """The temperature of the head's labels: T=1 ('t1') or the verification's ('verify')."""
    return 1.0 if label == "t1" else temperature


def step_labels(fb: StepFeedback, label: str) -> tuple[list[tuple[int, int]], list[float]] | None:
    """Per target proposal up to and including the first rejection: its drafter-token span and its
    label min(1, p_T(y) / q_T(y)) at the label temperature T (q of a merged n-gram: the product of
    its sub-tokens'); at T=0 that is its limit, 1 when y is the target's argmax (exactly greedy
    verification's accept) and 0 otherwise. None when the step proposed nothing or the drafter
    recorded no hidden states (a verification with nothing proposed: the loop's last one-token step).
    """
    prop = fb.proposal
    m = len(prop.ids)
    if not m or prop.hidden is None:
        return None
    groups = [(s.start, s.end) for s in prop.spans][: min(m, fb.n_accepted + 1)]
    rows = fb.rows[: len(groups)].float()
    t = label_temperature(label, fb.temperature)
    if t <= 0:
        top = rows.argmax(-1).tolist()
        return groups, [float(top[i] == prop.ids[i]) for i in range(len(groups))]
    p = torch.softmax(rows / t, -1)
    labels = []
    for i, (s, e) in enumerate(groups):
        q = 1.0
        for j in range(s, e):
            q *= prop.draft_probs[j]
        labels.append(min(1.0, float(p[i, prop.ids[i]]) / max(q, 1e-12)))
    return groups, labels


class AcceptanceHead(nn.Module):
    """x -> n_blocks x (x + SiLU(Linear(x))) -> Linear -> logit of P(accept)."""

    def __init__(self, hidden_size: int, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(n_blocks))
        self.out = nn.Linear(hidden_size, 1)
        for b in self.blocks:  # start near identity, predicting ~0.5
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        for b in self.blocks:
            x = x + F.silu(b(x))
        return self.out(x).squeeze(-1)


class HeadLearner:
    """Online training of an :class:`AcceptanceHead` from verification results.

    Args:
        mode: 'joint' (trained in the distillation update: with an online learner attached,
            :meth:`omnidraft.learn.online.OnlineLearner.attach_head`, each of its mini-batches minimises
            L_distill + L_head on the training copy's hidden states, the head's gradient reaching
            the drafter too; without one, the head alone updates at the distillation interval on
            what was collected since) or 'interleaved' (update every ``every`` prompts from a FIFO
            replay buffer of ``replay`` proposals, ``steps`` mini-batches each time, on the hidden
            states recorded while drafting, detached).
        learn: False serves the head frozen: only the calibration is recorded.
        label: 'verify' (labels at the verification temperature; greedy: accept indicator) or
            't1' (min(1, p/q) at T=1).
    """

    needs_rows = True  # learns from the verification rows (omnidraft.core.feedback.Observer)

    def __init__(self, head: AcceptanceHead, *, mode: str = "joint", lr: float = 1e-3,
                 mismatch_weight: float = 6.0, batch_size: int = 64, replay: int = 4096,
                 steps: int = 4, every: int = 1, seed: int = 0, learn: bool = True, label: str = "verify"):
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode must be one of {HEAD_MODES}, got {mode!r}")
        if label not in HEAD_LABELS:
            raise ValueError(f"head label must be one of {HEAD_LABELS}, got {label!r}")
        self.label = label
        self.head, self.mode, self.w = head, mode, float(mismatch_weight)
        self.batch_size, self.steps, self.every = int(batch_size), int(steps), int(every)
        self.buffer: deque = deque(maxlen=int(replay) if mode == "interleaved" else None)
        self.opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
        self.rng = random.Random(seed)
        self.n_updates = 0
        self.learn = bool(learn)  # False: calibration only, the head stays frozen
        self.in_learner = False  # True: trained inside the drafter's update (attach_head), no buffer here
        # calibration since the last read: predicted vs observed acceptance of merged proposals
        self._pred_sum = self._obs_sum = self._debiased_sum = 0.0
        self._n = 0

    @property
    def learns(self) -> bool:
        """Whether what it observes changes later drafting (Session.learns): a frozen head only records."""
        return self.learn

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def observe(self, fb: StepFeedback) -> None:
        """Record one step's verification (observer of the decode loop)."""
        require_rows(fb, "the acceptance head")
        out = step_labels(fb, self.label)
        if out is not None:
            groups, labels = out
            self.record(fb.proposal.hidden, groups, labels, [i < fb.n_accepted for i in range(len(groups))])

    @torch.no_grad()
    def record(self, hidden: torch.Tensor, groups: list[tuple[int, int]], labels: list[float],
               accepted: list[bool]) -> None:
        """One step: drafter hidden states (n_draft, H) and, per target proposal up to the first
        rejection, its drafter-token span, soft label and whether it was accepted."""
        logp = F.logsigmoid(self.head(hidden.float()))
        for (s, e), y, a in zip(groups, labels, accepted):
            if self.learn and not self.in_learner:
                self.buffer.append((hidden[s:e].detach().float().cpu(), float(y)))
            pred = float(logp[s:e].sum().exp())
            self._pred_sum += pred
            self._debiased_sum += self.w * pred / (1.0 - pred + self.w * pred)
            self._obs_sum += float(a)
            self._n += 1

    def calibration(self, reset: bool = True) -> dict[str, float]:
        """Mean predicted vs observed acceptance of the proposals since the last read.

        The weighted BCE's minimiser for a proposal accepted with probability y is
        y / (y + w (1 - y)), not y: with ``mismatch_weight`` w > 1 the head predicts low by design
        (the stop rule is conservative). ``head/pred_accept_debiased`` inverts that map per
        proposal, w p / (1 - p + w p): the head's implied acceptance, comparable with
        ``head/obs_accept``."""
        out = {}
        if self._n:
            out = {"head/pred_accept": self._pred_sum / self._n, "head/obs_accept": self._obs_sum / self._n,
                   "head/pred_accept_debiased": self._debiased_sum / self._n, "head/n": self._n}
        if reset:
            self._pred_sum = self._obs_sum = self._debiased_sum = 0.0
            self._n = 0
        return out

    def loss(self, items: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        """Weighted BCE of prod_j sigmoid(head(h_j)) over each proposal's drafter tokens."""
        dev = next(self.head.parameters()).device  # the buffer lives on the CPU
        logp = torch.stack([F.logsigmoid(self.head(h.to(dev))).sum() for h, _ in items])
        y = torch.tensor([lab for _, lab in items], device=dev)
        log1mp = torch.log1p(-logp.exp().clamp(max=1 - 1e-6))
        return -(y * logp + self.w * (1 - y) * log1mp).mean()

    def update(self) -> dict[str, float]:
        if not self.learn or self.in_learner or not self.buffer:
            return {}
        items = list(self.buffer)
        self.head.train()
        total, n = 0.0, 0
        if self.mode == "joint":
            self.rng.shuffle(items)
            batches = [items[b: b + self.batch_size] for b in range(0, len(items), self.batch_size)]
        else:
            batches = [self.rng.sample(items, min(self.batch_size, len(items))) for _ in range(self.steps)]
        for batch in batches:
            loss = self.loss(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            total += float(loss.detach())
            n += 1
        self.head.eval()
        if self.mode == "joint":
            self.buffer.clear()
        self.n_updates += 1
        return {"head/loss": total / max(1, n), "head/n_updates": self.n_updates}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {f"head.{k}": v.detach().contiguous() for k, v in self.head.state_dict().items()}
        opt_tensors, opt_meta = optimizer_state(self.opt, "head_opt")
        tensors.update(opt_tensors)
        for j, (h, _) in enumerate(self.buffer):
            tensors[f"head_buf.{j}"] = h.contiguous()
        meta = {**opt_meta, "labels": [y for _, y in self.buffer], "rng": rng_state(self.rng),
                "n_updates": self.n_updates}
        return tensors, meta

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.head.load_state_dict({k[len("head."):]: v for k, v in tensors.items() if k.startswith("head.")})
        load_optimizer_state(self.opt, tensors, meta, "head_opt")
        self.buffer.clear()
        if not self.in_learner:  # a head trained inside the drafter's update has no buffer of its own
            for j, y in enumerate(meta["labels"]):
                self.buffer.append((tensors[f"head_buf.{j}"], y))
        set_rng_state(self.rng, meta["rng"])
        self.n_updates = int(meta["n_updates"])
