"""The second generation backend: ``transformers`` ``generate`` behind the ``Engine`` interface.

Same contract as ``policies.engines`` (its docstring: one log-prob and one
version per response token); built by ``engines.make_engine`` for
``rollout.engine = "transformers"``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from reflow.policies.engines import EngineSettings
from reflow.storage.schema import GenRequest, GenResult


class TransformersEngine:
    """Batched sampling with ``transformers``; for machines without vLLM."""

    def __init__(self, settings: EngineSettings, version: int = 0, device: str = "cpu") -> None:
        self.settings = settings
        self.version = version
        self.device = torch.device(device)
        dtype = getattr(torch, settings.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=dtype).to(self.device)
        self.model.eval()
        self._queue: list[GenRequest] = []
        # generate() samples from torch's global generator (it takes no generator argument); seed it so that
        # run.seed decides the samples and a repeated run draws the same ones.
        torch.manual_seed(settings.seed)
        self._tok: Any = None  # loaded when a request has stop strings

    def submit(self, requests: Sequence[GenRequest]) -> None:
        self._queue.extend(requests)

    def num_unfinished(self) -> int:
        return len(self._queue)

    def pending_ids(self) -> list[str]:
        return [r.request_id for r in self._queue]

    def rest(self) -> bool:
        """Nothing to free: between batches this engine holds only its weights (no KV cache outlives
        ``collect``), and they are what it generates with next."""
        return False

    def abort(self, request_ids: Sequence[str]) -> list[GenResult]:
        """Drop queued requests (nothing is generated before ``collect``, so nothing is partial)."""
        drop = set(request_ids)
        aborted = [GenResult(r.request_id, [], [], "abort", [], self.version) for r in self._queue
                   if r.request_id in drop]
        self._queue = [r for r in self._queue if r.request_id not in drop]
        return aborted

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        """Generate one batch of up to ``max_concurrent_sequences`` queued requests."""
        batch = self._queue[: self.settings.max_concurrent_sequences]
        self._queue = self._queue[len(batch):]
        return self._sample(batch) if batch else []

    @torch.no_grad()
    def _sample(self, batch: list[GenRequest]) -> list[GenResult]:
        """Left-padded ancestral sampling with a KV cache; exact temperature-1 log-probs.

        A resumed request's prompt is its prompt plus its resumed tokens.
        """
        pad = self.settings.eos_token_id
        prompts = [list(r.prompt_tokens) + list(r.resume_tokens) for r in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        steps = max(r.max_tokens - len(r.resume_tokens) for r in batch)
        # generate's stop strings end every row of the batch that hits one: only when all rows share them
        # (the tool driver's case); otherwise rows are cut after the fact (``_trim``).
        stops = {r.stop for r in batch}
        shared = next(iter(stops)) if len(stops) == 1 else ()
        extra = {"stop_strings": list(shared), "tokenizer": self._tokenizer()} if shared else {}
        out = self.model.generate(input_ids=ids, attention_mask=attn, do_sample=True,
                                  temperature=self.settings.temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=steps, eos_token_id=pad, pad_token_id=pad,
                                  output_scores=True, return_dict_in_generate=True, **extra)
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).float()  # (B, steps, V) after temperature
        logp = torch.log_softmax(scores, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return [self._trim(r, new[i], logp[i]) for i, r in enumerate(batch)]

    def _trim(self, req: GenRequest, tokens: torch.Tensor, logp: torch.Tensor) -> GenResult:
        toks = tokens.tolist()[: req.max_tokens - len(req.resume_tokens)]
        eos = self.settings.eos_token_id
        reason = "length"
        if eos in toks:
            toks, reason = toks[: toks.index(eos) + 1], "stop"
        if req.stop:  # a stop string ends the sample first (generate pads a stopped row with EOS)
            end = self._stop_end(toks, req.stop)
            if end is not None:
                toks, reason = toks[:end], "stop"
        n = len(toks)
        submitted = self.version if req.submitted_version is None else req.submitted_version
        return GenResult(req.request_id, list(req.resume_tokens) + toks,
                         list(req.resume_logprobs) + logp[:n].tolist(), reason,
                         list(req.resume_versions) + [self.version] * n, submitted)

    def _tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = AutoTokenizer.from_pretrained(self.settings.model_dir)
        return self._tok

    def _stop_end(self, tokens: list[int], stops: tuple[str, ...]) -> int | None:
        """Length of the shortest prefix of ``tokens`` whose text contains a stop string (None: no stop)."""
        decode = lambda ids: self._tokenizer().decode(ids, skip_special_tokens=False)  # noqa: E731
        if not any(s in decode(tokens) for s in stops):
            return None
        lo, hi = 1, len(tokens)  # containment is monotone in the prefix length: binary search
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(tokens[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state, strict=False)
        self.version = version
