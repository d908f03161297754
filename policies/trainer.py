"""The GRPO trainer: a torch model, AdamW, token-budget micro-batches.

Written for one process and for FSDP2 across ranks: when ``torch.distributed``
is initialised with more than one rank, every decoder layer and the root are
wrapped with ``fully_shard``. Each rank then steps on its share of the batch
(``split_by_tokens``) with the batch's global loss normaliser, so the update is
the one-rank update on the whole batch; ``export_weights`` gathers full tensors
and checkpoints are sharded (``torch.distributed.checkpoint``). Every method
that touches the weights is then a collective: all ranks call it together.

On one rank, a step can also take **gradient helpers** (``GradientHelper``:
the elastic pool's flex workers while they train). The batch's samples with a
gradient are split by tokens between the trainer and its helpers; each helper
loads the trainer's weights of the moment (when it lacks them), runs forward
and backward on its share with the batch's global normaliser, and returns the
summed gradients; the trainer adds them to its own and takes the optimiser
step. The optimiser state never leaves the trainer, so however many helpers
join a step the update is the one-trainer update on the same batch (up to the
order of float additions).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from reflow.config.schema import TrainConfig
from reflow.policies import grpo
from reflow.policies.losses import LossInputs, get_policy_loss
from reflow.storage.metrics import TrainStep

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TrainSample:
    """One trajectory as the trainer sees it (one log-prob and mask entry per response token)."""

    prompt_tokens: list[int]
    response_tokens: list[int]
    behaviour_logprobs: list[float]
    loss_mask: list[int]
    advantage: float
    loss_weight: float
    # log-probs of the response tokens under the weights at the start of the step (``Trainer.with_proximal``);
    # None: the loss takes the current log-probs, detached (one optimiser step per batch)
    proximal_logprobs: list[float] | None = None


@dataclass(frozen=True)
class GradientShare:
    """What a helper returns for its share of a step: gradients and the loss figures, summed."""

    grads: dict[str, torch.Tensor]  # parameter name -> gradient (empty: the share had nothing to train)
    sums: dict[str, float]  # loss, kl, entropy, clip, ratio: sums as ``Trainer._micro_step`` returns them
    passes: int  # forward and backward passes it ran
    seconds: float = 0.0
    loaded_weights: bool = False  # whether it had to load the trainer's weights first
    extra: dict[str, Any] = field(default_factory=dict)


class GradientHelper(Protocol):
    """A worker that computes gradients on a share of a step (``Trainer.step``'s ``helpers``)."""

    def start(self, samples: list[TrainSample], normaliser: float, weights_id: int) -> Any:
        """Start on ``samples`` under the trainer's weights ``weights_id`` (``Trainer.weights_id``); a handle."""
        ...

    def collect(self, handle: Any) -> GradientShare: ...


def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices so that ``len(group) * max_length(group) <= token_budget``.

    Samples are taken shortest first, so padding stays small; a sample longer
    than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def split_by_tokens(lengths: list[int], ranks: int) -> list[list[int]]:
    """Deal sample indices to ``ranks`` shares of nearly equal token counts (longest first, to the lightest share).

    Each share keeps its indices in batch order. A share may be empty when
    there are fewer samples than ranks.
    """
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lightest = min(range(ranks), key=lambda r: (load[r], len(shares[r]), r))
        shares[lightest].append(i)
        load[lightest] += lengths[i]
    return [sorted(share) for share in shares]


def _collate(samples: list[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded (B, L) ids and (B, L-1) targets aligned to next-token positions."""
    full = [s.prompt_tokens + s.response_tokens for s in samples]
    width = max(len(f) for f in full)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1))
    behaviour = torch.zeros((len(samples), width - 1))
    with_proximal = [s.proximal_logprobs is not None for s in samples]
    if any(with_proximal) and not all(with_proximal):
        raise ValueError("a micro-batch mixes samples with and without proximal log-probs")
    proximal = torch.zeros((len(samples), width - 1)) if all(with_proximal) else None
    for i, (s, f) in enumerate(zip(samples, full)):
        ids[i, : len(f)] = torch.tensor(f)
        attn[i, : len(f)] = 1
        start, end = len(s.prompt_tokens) - 1, len(f) - 1  # position t predicts token t+1
        mask[i, start:end] = torch.tensor(s.loss_mask, dtype=torch.float)
        behaviour[i, start:end] = torch.tensor(s.behaviour_logprobs)
        if proximal is not None:
            proximal[i, start:end] = torch.tensor(s.proximal_logprobs)
    out = {"ids": ids, "attn": attn, "mask": mask, "behaviour": behaviour,
           "adv": torch.tensor([s.advantage for s in samples]),
           "weight": torch.tensor([s.loss_weight for s in samples])}
    return out if proximal is None else out | {"proximal": proximal}


class Trainer:
    """Owns the policy weights and the optimiser; one ``step`` per batch."""

    def __init__(self, model_dir: str, cfg: TrainConfig, seed: int, device: str = "cpu",
                 dtype: str = "float32", version: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.policy_loss = get_policy_loss(cfg.policy_loss)
        self.model_dir = model_dir
        self.device = torch.device(device)
        self.version = version
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.pad_id = int(self.model.config.pad_token_id or self.model.config.eos_token_id or 0)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            self.reference.to(self.device).eval().requires_grad_(False)
        self._maybe_shard()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
        # Which weights the model holds: +1 per optimiser step (minibatches included); a helper with other ones
        # loads the trainer's before its share. Not the policy version, which moves once per batch. It starts
        # at random, so a trainer restarted by Ray never repeats an id a helper still holds other weights under.
        self.weights_id = uuid.uuid4().int >> 80

    def _maybe_shard(self) -> None:
        """FSDP2: shard each decoder layer, then the root, when running on several ranks."""
        dist = torch.distributed
        self._sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank, self.world = 0, 1
        if not self._sharded:
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def _global(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` summed (or their maximum) over every rank; unchanged on one rank."""
        if not self._sharded:
            return values
        dist = torch.distributed
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor.tolist()

    def warm_up(self, max_sequence_tokens: int) -> float:
        """Forward and backward passes on dummy micro-batches; returns the seconds it took.

        One micro-batch per padded length 16, 32, ... up to
        ``max_sequence_tokens`` (prompt + response), each with as many rows
        as ``micro_batch_tokens`` allows, through the same loss as ``step``:
        the process allocates its peak activation memory once, before the
        run's clock starts. With the workers' allocator settings
        (``infra.placement.worker_env``) that memory stays in the process, so
        no step pays for first-touch page faults again (on the CPU VM the
        first step of a run took 6 to 7 s where the next took 0.5 s).
        Gradients are dropped: the weights, the optimiser state, the version
        and torch's RNG are as before.
        """
        start = time.perf_counter()
        rng = torch.get_rng_state()
        self.model.train()
        token = 1 if self.pad_id == 0 else 0
        length = 16
        while True:
            length = min(length, max(2, max_sequence_tokens))
            rows = max(1, self.cfg.micro_batch_tokens // length)
            half = length // 2
            dummy = TrainSample([token] * (length - half), [token] * half, [-1.0] * half,
                                [1] * half, advantage=1.0, loss_weight=1.0)
            self._micro_step([dummy] * rows, float(rows * half))
            self.optimizer.zero_grad(set_to_none=True)
            if length >= max_sequence_tokens:
                break
            length *= 2
        torch.set_rng_state(rng)
        return time.perf_counter() - start

    def skippable(self, sample: TrainSample) -> bool:
        """Whether ``sample``'s gradient is exactly zero, so forward and backward can be skipped.

        With ``kl_coef == 0`` the loss is ``sum_t w * m_t * loss_t / normaliser`` and every policy loss
        here is ``-w_t * min(r_t A, clip(r_t) A)``: with ``A == 0`` (a GRPO group whose rewards are all
        equal) or loss weight 0, each term and its gradient is 0, whatever the logits. The KL term
        depends on every sample, so nothing is skipped when it is on. (Across ranks, a rank left with
        fewer micro-batches runs empty ones: FSDP needs every rank to run as many passes.)
        """
        return (self.cfg.skip_zero_advantage and self.reference is None
                and (sample.advantage == 0.0 or sample.loss_weight == 0.0))

    def step(self, samples: list[TrainSample], helpers: Sequence[GradientHelper] = ()) -> TrainStep:
        """One batch: ``train.minibatches_per_step`` optimiser steps (gradients accumulated over micro-batches).

        With one minibatch (the default) the loss normaliser counts every sample of the batch, skipped
        ones included (``skippable``), so skipping changes no gradient. With ``k > 1`` the trainer
        first records each sample's log-probs under the starting weights (``with_proximal``: the
        proximal policy of the decoupled loss), then splits the batch into ``k`` minibatches of nearly
        equal tokens (``minibatches``) and steps on each in turn, each with its own normaliser and
        learning rate, as PPO's minibatch epochs do; ``k`` is cut to the number of samples with a
        gradient, so no step is taken on a minibatch without one. The version moves by one per batch
        whatever ``k``. Entropy, clip fraction and ratio are means over the tokens trained on; loss,
        gradient norm and learning rate are means over the minibatches. Sharded, ``samples`` is this
        rank's share: each rank splits its share into ``k``, minibatch ``j`` is the union of the ranks'
        ``j``-th parts, and every figure returned is the whole batch's. ``helpers`` (one rank only) share
        each optimiser step's forward and backward passes (module docstring).
        """
        start = time.perf_counter()
        self.model.train()
        with_gradient = int(self._global([sum(not self.skippable(s) for s in samples)])[0])
        k = max(1, min(self.cfg.minibatches_per_step, with_gradient))
        if k > 1:
            samples = self.with_proximal(samples)
        parts = [self._optimizer_step(part, helpers)
                 for part in (self.minibatches(samples, k) if k > 1 else [samples])]
        self.version += 1
        total = {key: sum(part[key] for part in parts) for key in parts[0]}
        per_token = float(max(total["trained_tokens"], 1))
        return TrainStep(version=self.version, loss=total["loss"] / k, kl=total["kl"] / per_token,
                         entropy=total["entropy"] / per_token, grad_norm=total["grad_norm"] / k,
                         clip_fraction=total["clip"] / per_token, importance_ratio_mean=total["ratio"] / per_token,
                         trained_tokens=int(total["trained_tokens"]), micro_batches=int(total["passes"]),
                         trainer_seconds=time.perf_counter() - start,
                         skipped_samples=int(total["batch_size"] - total["trained_samples"]),
                         skipped_tokens=int(total["loss_tokens"] - total["trained_tokens"]),
                         learning_rate=total["learning_rate"] / k, helpers=len(helpers) if not self._sharded else 0,
                         helper_samples=int(total["helper_samples"]))

    def minibatches(self, samples: list[TrainSample], k: int) -> list[list[TrainSample]]:
        """``samples`` in ``k`` minibatches: those with a gradient dealt by tokens (``split_by_tokens``), the
        skippable ones (which only count in a minibatch's normaliser) dealt in turn; batch order kept."""
        active = [i for i, s in enumerate(samples) if not self.skippable(s)]
        shares = split_by_tokens([len(samples[i].prompt_tokens) + len(samples[i].response_tokens) for i in active],
                                 k)
        owner = {active[j]: part for part, share in enumerate(shares) for j in share}
        skipped = [i for i in range(len(samples)) if i not in owner]
        owner |= {i: n % k for n, i in enumerate(skipped)}
        return [[s for i, s in enumerate(samples) if owner[i] == part] for part in range(k)]

    @torch.no_grad()
    def with_proximal(self, samples: list[TrainSample]) -> list[TrainSample]:
        """``samples`` with ``proximal_logprobs``: each response token's log-prob under the current weights.

        Forward passes only (no gradient), packed as ``step`` packs them; skippable samples are not
        forwarded and keep None. Sharded, every rank runs as many passes (a collective).
        """
        out = list(samples)
        active = [i for i, s in enumerate(samples) if not self.skippable(s)]
        groups = pack_micro_batches([len(samples[i].prompt_tokens) + len(samples[i].response_tokens) for i in active],
                                    self.cfg.micro_batch_tokens)
        passes = int(self._global([len(groups)], op="max")[0])
        for k in range(passes):
            index = [active[i] for i in groups[k]] if k < len(groups) else []
            batch = {key: v.to(self.device) for key, v in
                     _collate([samples[i] for i in index] or [self._empty_sample()], self.pad_id).items()}
            logits = self.model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1]
            logp = grpo.token_logprobs(logits, batch["ids"][:, 1:]).float().cpu()
            for row, i in enumerate(index):
                s = samples[i]
                begin = len(s.prompt_tokens) - 1
                out[i] = dataclasses.replace(s, proximal_logprobs=logp[row, begin:begin + len(s.response_tokens)]
                                             .tolist())
        return out

    def _optimizer_step(self, samples: list[TrainSample], helpers: Sequence[GradientHelper] = ()) -> dict[str, float]:
        """One optimiser step on ``samples`` (a batch or one of its minibatches); the whole batch's sums.

        With ``helpers`` the samples with a gradient are split by tokens into ``1 + len(helpers)`` shares; the
        helpers start on theirs first, so they compute while this process runs its own share.
        """
        loss_tokens = int(sum(sum(s.loss_mask) for s in samples))
        active = [s for s in samples if not self.skippable(s)]
        trained_tokens = int(sum(sum(s.loss_mask) for s in active))
        loss_tokens, batch_size, trained_tokens, trained_samples = (int(v) for v in self._global(
            [loss_tokens, len(samples), trained_tokens, len(active)]))
        normaliser = float(max(loss_tokens, 1)) if self.cfg.loss_agg == "token_mean" else float(batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        helpers = list(helpers) if not self._sharded else []
        started, helper_samples = [], 0
        if helpers and active:
            shares = split_by_tokens([len(s.prompt_tokens) + len(s.response_tokens) for s in active],
                                     1 + len(helpers))
            for helper, share in zip(helpers, shares[1:]):
                if share:
                    started.append((helper, helper.start([active[i] for i in share], normaliser, self.weights_id)))
                    helper_samples += len(share)
            active = [active[i] for i in shares[0]]
        groups = pack_micro_batches([len(s.prompt_tokens) + len(s.response_tokens) for s in active],
                                    self.cfg.micro_batch_tokens)
        passes = int(self._global([len(groups)], op="max")[0])
        sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip": 0.0, "ratio": 0.0}
        for k in range(passes):
            part = self._micro_step([active[i] for i in groups[k]] if k < len(groups) else [self._empty_sample()],
                                    normaliser)
            for key in sums:
                sums[key] += part[key]
        named = dict(self.model.named_parameters())
        for helper, handle in started:
            share = helper.collect(handle)
            passes += share.passes
            for key in sums:
                sums[key] += share.sums[key]
            for name, grad in share.grads.items():
                p = named[name]
                p.grad = grad.to(p.device, p.dtype) if p.grad is None else p.grad.add_(grad.to(p.device, p.dtype))
        # a zero gradient, not a missing one: AdamW still decays its moments and steps
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # sharded: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        lr = self.step_learning_rate(samples)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step()
        self.weights_id += 1
        sums = dict(zip(sums, self._global(list(sums.values()))))
        return sums | {"grad_norm": float(grad_norm), "learning_rate": lr, "passes": passes,
                       "loss_tokens": loss_tokens, "batch_size": batch_size, "trained_tokens": trained_tokens,
                       "trained_samples": trained_samples, "helper_samples": helper_samples}

    def gradients(self, samples: list[TrainSample], normaliser: float) -> GradientShare:
        """A helper's share of a step (``GradientHelper``): forward and backward on ``samples`` with the
        batch's ``normaliser``; the summed gradients, nothing stepped. One rank only."""
        if self._sharded:
            raise RuntimeError("Trainer.gradients runs on one rank (a flex worker), not on a sharded trainer")
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        active = [s for s in samples if not self.skippable(s)]
        groups = pack_micro_batches([len(s.prompt_tokens) + len(s.response_tokens) for s in active],
                                    self.cfg.micro_batch_tokens)
        sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip": 0.0, "ratio": 0.0}
        for group in groups:
            part = self._micro_step([active[i] for i in group], normaliser)
            for key in sums:
                sums[key] += part[key]
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return GradientShare(grads=grads, sums=sums, passes=len(groups), seconds=time.perf_counter() - start)

    def load_weights(self, weights: dict[str, torch.Tensor], weights_id: int) -> None:
        """Take the trainer's weights ``weights_id`` (a flex worker before its share; one rank only)."""
        self.model.load_state_dict(weights)
        self.weights_id = weights_id

    def _empty_sample(self) -> TrainSample:
        """A two-token sample with no loss token and weight 0: a pass whose gradient is exactly zero."""
        token = 1 if self.pad_id == 0 else 0
        return TrainSample([token], [token], [0.0], [0], advantage=0.0, loss_weight=0.0)

    def step_learning_rate(self, samples: list[TrainSample]) -> float:
        """``learning_rate``, times the mean loss weight of the samples with a gradient (``lr_by_weight``).

        AdamW divides each coordinate's step by its running gradient scale,
        so scaling every sample's loss by ``w`` leaves the step's size nearly
        unchanged; scaling the learning rate by the batch's mean weight is
        what makes a batch of samples weighted ``w`` move the weights ``w``
        times as far. The mean is over samples with a non-zero advantage and
        weight (whether or not ``skippable`` leaves the others out), summed
        over every rank when sharded so all ranks step alike; a batch with
        none keeps the full rate.
        """
        if not self.cfg.lr_by_weight:
            return self.cfg.learning_rate
        weights = [s.loss_weight for s in samples if s.advantage != 0.0 and s.loss_weight != 0.0]
        total, count = float(sum(weights)), float(len(weights))
        if self._sharded:
            sums = torch.tensor([total, count], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(sums)
            total, count = float(sums[0]), float(sums[1])
        return self.cfg.learning_rate * total / count if count else self.cfg.learning_rate

    def _micro_step(self, samples: list[TrainSample], normaliser: float) -> dict[str, float]:
        batch = {k: v.to(self.device) for k, v in _collate(samples, self.pad_id).items()}
        logits = self.model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1]
        targets = batch["ids"][:, 1:]
        logp = grpo.token_logprobs(logits, targets)
        mask = batch["mask"]
        per_token, clipped = self.policy_loss(LossInputs(logp, batch["behaviour"], batch["adv"], mask,
                                                         batch.get("proximal")), self.cfg)
        kl = torch.zeros_like(logp)
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1]
            kl = grpo.kl_k3(logp, grpo.token_logprobs(ref_logits, targets))
            per_token = per_token + self.cfg.kl_coef * kl
        loss = grpo.aggregate(per_token, mask, batch["weight"], self.cfg.loss_agg, normaliser)
        (loss * self.world).backward()  # FSDP averages gradients over ranks; the loss is a sum over the batch
        with torch.no_grad():
            entropy = grpo.entropy_from_logits(logits.detach())
            ratio = torch.exp(logp.detach() - batch["behaviour"])
        return {"loss": float(loss.detach()), "kl": float((kl.detach() * mask).sum()),
                "entropy": float((entropy * mask).sum()), "clip": float((clipped * mask).sum()),
                "ratio": float((ratio * mask).sum())}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU tensors under Hugging Face names."""
        out = {}
        for name, tensor in self.model.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach().to("cpu", copy=True)
        return out

    def save_checkpoint(self, path: str | Path) -> Path:
        """Model, optimiser, RNG and version, written to a temp dir then renamed.

        ``trainer.pt`` (written last: a directory holding it is complete) has
        the full weights, the version and the number of ranks. On one rank it
        also holds the optimiser and the RNG states; sharded, each rank writes
        its shard of the weights and optimiser through
        ``torch.distributed.checkpoint`` (``sharded/``) and its RNG states
        (``rng-<rank>.pt``), and the run directory must be on a filesystem
        every rank sees.
        """
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        rng = {"torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state(),
               "python_rng": random.getstate()}
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        state = {"version": self.version, "ranks": self.world}
        if self._sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            torch.distributed.barrier()  # the directory exists
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp / "sharded")
            torch.save(rng, tmp / f"rng-{self.rank}.pt")
        else:
            state |= {"optimizer": self.optimizer.state_dict(), **rng}
        weights = self.export_weights()  # a collective when sharded
        if self._sharded:
            torch.distributed.barrier()  # every shard is written
        if self.rank == 0:
            torch.save({"model": weights, **state}, tmp / "trainer.pt")
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        if self._sharded:
            torch.distributed.barrier()  # no rank returns before the checkpoint is in place
        return path

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore a ``save_checkpoint`` directory; returns the version.

        Only onto as many ranks as saved it: the RNG states are per rank, and
        a step's split of the batch depends on the number of ranks, so a run
        resumed on another number would not continue the same run. (The
        weights alone, ``trainer.pt``'s ``model``, load anywhere.)
        """
        path = Path(path)
        state = torch.load(path / "trainer.pt", weights_only=False)
        saved = int(state.get("ranks", 1))
        if saved != self.world:
            raise ValueError(f"checkpoint {path} was saved by {saved} trainer rank(s) and this trainer has "
                             f"{self.world}: resume with resources.trainer_ranks={saved}")
        if self._sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            sharded = {"model": model_state, "optimizer": optim_state}
            dcp.load(sharded, checkpoint_id=path / "sharded")
            set_state_dict(self.model, self.optimizer, model_state_dict=sharded["model"],
                           optim_state_dict=sharded["optimizer"])
            rng = torch.load(path / f"rng-{self.rank}.pt", weights_only=False)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            rng = state
        self.weights_id += 1  # other weights: a helper must load them
        torch.set_rng_state(rng["torch_rng"])
        np.random.set_state(rng["numpy_rng"])
        random.setstate(rng["python_rng"])
        self.version = int(state["version"])
        return self.version

    def save_hf(self, out_dir: str | Path) -> Path:
        """The current policy as a Hugging Face directory (weights + tokenizer files; rank 0 writes it)."""
        out = Path(out_dir)
        weights = self.export_weights()  # a collective when sharded
        if self.rank:
            return out
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out, state_dict=weights)
        for name in TOKENIZER_FILES:
            src = Path(self.model_dir) / name
            if src.exists():
                shutil.copy2(src, out / name)
        return out
