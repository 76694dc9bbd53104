"""The policy update of the GRPO loop: group-normalised advantages and a clipped policy-gradient step in torch.

:class:`PolicyTrainer` holds the policy (the real model, full fine-tuning, float32 master weights,
AdamW) and updates it on a batch of rollouts: the token-level PPO-clip loss of GRPO / DAPO
(Shao et al. 2024, DeepSeekMath eq. 3; clip-higher and the token mean from Yu et al. 2025, DAPO),
against log-probabilities recomputed before the update, ``mini_batches`` optimizer steps per call
so the later ones are off-policy and clipping acts, and an optional k3 KL to the initial policy.
:func:`group_advantages` is verl's GRPO advantage estimator. Used by :mod:`integrations.rl.grpo`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

__all__ = ["group_advantages", "PolicyTrainer"]


# ----------------------------------------------------------------------------------------------
# advantages


def group_advantages(rewards: Sequence[float], groups: Sequence[int], *, mode: str = "grpo", std_normalize: bool = True, eps: float = 1e-6) -> list[float]:
    """Advantages of ``rewards``: ``grpo`` normalises within each group (same ``groups`` id), ``batch`` over all.

    ``(r - mean) / (std + eps)`` with the unbiased std (as verl's GRPO estimator), or ``r - mean``
    when ``std_normalize`` is False. A group whose rewards are all equal gets zeros.
    """
    import torch

    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    if mode == "batch":
        keys = [0] * len(rewards)
    elif mode == "grpo":
        keys = list(groups)
    else:
        raise ValueError(f"mode must be 'grpo' or 'batch', got {mode!r}")
    out = torch.zeros_like(r)
    for g in sorted(set(keys)):
        idx = torch.tensor([i for i, k in enumerate(keys) if k == g])
        x = r[idx]
        centred = x - x.mean()
        if std_normalize:
            std = x.std() if len(x) > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps) if float(std) > 0 else torch.zeros_like(x)
        out[idx] = centred
    return [float(v) for v in out]


# ----------------------------------------------------------------------------------------------
# policy update


class PolicyTrainer:
    """The policy in torch (full fine-tuning, float32 master weights, AdamW) and its GRPO update.

    Args:
        model_dir: Hugging Face model directory (the same weights the engine started from).
        cfg: :class:`integrations.rl.recipes.TrainSection`.
        seed: seeds the mini-batch shuffling.
    """

    def __init__(self, model_dir: str, cfg: Any, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        dtype = torch.float32 if cfg.dtype == "float32" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.config.use_cache = False
        self.model.train()
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8)
        self.rng = random.Random(seed)
        self.seed = int(seed)
        self.steps_done = 0

    def _micro_batches(self, seqs: list[int], lengths: list[int]) -> list[list[int]]:
        out, cur, tokens = [], [], 0
        for i in seqs:
            if cur and tokens + lengths[i] > self.cfg.micro_batch_tokens:
                out.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += lengths[i]
        if cur:
            out.append(cur)
        return out

    def _logprobs(self, model: Any, batch: list[tuple[list[int], list[int]]]):
        """Per-token log-probabilities of each response given its prompt, for a micro-batch."""
        import torch
        import torch.nn.functional as F

        pad = 0
        width = max(len(p) + len(o) for p, o in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for b, (p, o) in enumerate(batch):
            seq = list(p) + list(o)
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            for j in range(len(o)):
                rows.append(b)
                cols.append(len(p) + j - 1)  # hidden state that predicts output token j
                targets.append(o[j])
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.cfg.autocast_bf16 else contextlib.nullcontext()
        with ctx:
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            h = hidden[torch.tensor(rows), torch.tensor(cols)]
            logits = model.lm_head(h).float()
        logp = -F.cross_entropy(logits, torch.tensor(targets), reduction="none")
        out, k = [], 0
        for _, o in batch:
            out.append(logp[k : k + len(o)])
            k += len(o)
        return out

    def logprobs(self, batch: list[tuple[list[int], list[int]]], model: Any = None) -> list[Any]:
        """No-grad log-probabilities (float32 tensors, one per response) under ``model`` (default: the policy)."""
        import torch

        model = model or self.model
        lengths = [len(p) + len(o) for p, o in batch]
        res: list[Any] = [None] * len(batch)
        with torch.no_grad():
            for mb in self._micro_batches(list(range(len(batch))), lengths):
                for i, lp in zip(mb, self._logprobs(model, [batch[i] for i in mb])):
                    res[i] = lp.detach()
        return res

    def step(self, batch: list[tuple[list[int], list[int]]], advantages: Sequence[float]) -> dict[str, float]:
        """One GRPO update on ``batch`` (prompt ids, response ids) with per-response ``advantages``.

        Responses with a zero advantage (and empty responses) are left out when
        ``skip_zero_advantage_groups`` (they carry no policy-gradient signal). Returns the step's
        metrics; ``updates`` is 0 when nothing was left to train on. Torch's global generator is
        seeded from ``(seed, step number)`` for the update and restored after it, so a model with
        dropout draws the same masks whatever the engine sampled before (two trainers of an A/B agree).
        """
        import torch

        self.steps_done += 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + self.steps_done)
            return self._step(batch, advantages)

    def _step(self, batch: list[tuple[list[int], list[int]]], advantages: Sequence[float]) -> dict[str, float]:
        import torch

        cfg = self.cfg
        keep = [i for i, (p, o) in enumerate(batch) if len(o) > 0 and (advantages[i] != 0.0 or not cfg.skip_zero_advantage_groups)]
        metrics = {"loss": 0.0, "pg_loss": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "grad_norm": 0.0,
                   "updates": 0, "train_sequences": len(keep), "train_tokens": sum(len(batch[i][1]) for i in keep)}
        if not keep:
            return metrics
        data = [batch[i] for i in keep]
        adv = [float(advantages[i]) for i in keep]
        old = self.logprobs(data)
        ref = self.logprobs(data, self.ref) if self.ref is not None else None
        lengths = [len(p) + len(o) for p, o in data]
        tokens_total = clipped_total = 0.0
        kl_sum = kl_ref_sum = loss_sum = pg_sum = 0.0
        for _ in range(cfg.epochs):
            order = list(range(len(data)))
            self.rng.shuffle(order)
            parts = [order[k :: cfg.mini_batches] for k in range(cfg.mini_batches)]
            for part in parts:
                if not part:
                    continue
                n_tok = sum(len(data[i][1]) for i in part)
                self.opt.zero_grad(set_to_none=True)
                for mb in self._micro_batches(sorted(part), lengths):
                    new = self._logprobs(self.model, [data[i] for i in mb])
                    lp = torch.cat(new)
                    lp_old = torch.cat([old[i] for i in mb])
                    a = torch.cat([torch.full((len(data[i][1]),), adv[i]) for i in mb])
                    log_ratio = lp - lp_old
                    ratio = torch.exp(log_ratio)
                    unclipped = ratio * a
                    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * a
                    pg = -torch.minimum(unclipped, clipped)
                    loss = pg.sum() / n_tok
                    pg_sum += float(pg.sum().detach())
                    if ref is not None:
                        d = torch.cat([ref[i] for i in mb]) - lp
                        k3 = torch.exp(d) - 1.0 - d
                        loss = loss + cfg.kl_coef * k3.sum() / n_tok
                        kl_ref_sum += float(k3.sum().detach())
                    loss.backward()
                    loss_sum += float(loss.detach()) * n_tok
                    with torch.no_grad():
                        clipped_total += float((clipped < unclipped).sum())  # the clipped term is the active one
                        kl_sum += float((-log_ratio).sum())
                    tokens_total += lp.numel()
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.opt.step()
                metrics["grad_norm"] = max(metrics["grad_norm"], float(norm))
                metrics["updates"] += 1
        self.opt.zero_grad(set_to_none=True)
        metrics.update(loss=loss_sum / tokens_total, pg_loss=pg_sum / tokens_total, clip_frac=clipped_total / tokens_total,
                       approx_kl=kl_sum / tokens_total, kl_ref=kl_ref_sum / tokens_total if ref is not None else 0.0)
        return metrics
