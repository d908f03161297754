"""``VLLMEngine``: vLLM's ``LLMEngine`` driven step by step in this process, weights swapped in place.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in the calling process,
so it can live inside a Ray actor and take new weights straight from memory
(``reload_weights``, no disk). vLLM is imported when an engine is built, so
importing this module does not need vLLM installed.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from reflow.policies.engines import EngineSettings, generate_all
from reflow.storage.schema import GenRequest, GenResult


class _Progress:
    """A running request: what it asked for and what it has produced, each token with its log-prob and version."""

    __slots__ = ("request", "submitted_version", "tokens", "logprobs", "versions", "engine_id")

    def __init__(self, request: GenRequest, submitted_version: int) -> None:
        self.request = request
        self.submitted_version = submitted_version if request.submitted_version is None else request.submitted_version
        self.tokens: list[int] = list(request.resume_tokens)
        self.logprobs: list[float] = list(request.resume_logprobs)
        self.versions: list[int] = list(request.resume_versions)
        self.engine_id = request.request_id  # the id inside vLLM (changes when the request is resumed)

    def add(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        if len(tokens) != len(logprobs):
            raise RuntimeError(f"engine returned {len(tokens)} tokens but {len(logprobs)} log-probs")
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(tokens))

    def result(self, reason: str) -> GenResult:
        return GenResult(self.request.request_id, self.tokens, self.logprobs, reason, self.versions,
                         self.submitted_version)


def _use_torch_linear_on_cpu() -> None:
    """Make vLLM's CPU backend run linear layers with ``torch.nn.functional.linear`` (its fallback path).

    vLLM 0.32 uses oneDNN when ``vllm._custom_ops._supports_onednn`` is set as
    the weights load: kernels per token count, 32 kept per layer, so a
    streaming round keeps building them (docs/operations.md "Memory on this machine").
    """
    import vllm._custom_ops as ops

    if hasattr(ops, "_supports_onednn"):
        ops._supports_onednn = False


class VLLMEngine:
    """vLLM's ``LLMEngine`` stepped in-process."""

    def __init__(self, settings: EngineSettings, version: int = 0) -> None:
        # Must be set before vLLM is imported: KV cache size on CPU, and keep the
        # engine core in this process so weights can be swapped from memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.kv_cache_gib))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if settings.cpu_linear == "torch":
            _use_torch_linear_on_cpu()

        from vllm.platforms import current_platform

        self.settings = settings
        self.version = version
        on_gpu = {}  # what only a GPU build takes: its memory share, and sleep mode for a flex worker's engine
        if current_platform.is_cuda_alike():
            on_gpu["gpu_memory_utilization"] = settings.gpu_memory_utilization
        self._can_sleep = settings.sleep_mode and current_platform.is_sleep_mode_available()
        if self._can_sleep:
            on_gpu["enable_sleep_mode"] = True
        self._llm = LLM(model=settings.model_dir, dtype=settings.dtype, seed=settings.seed,
                        max_model_len=settings.max_model_len,
                        max_num_seqs=settings.max_concurrent_sequences,
                        enforce_eager=settings.enforce_eager, enable_prefix_caching=True,
                        disable_log_stats=True, **on_gpu)
        self._engine = self._llm.llm_engine
        # Stop strings need detokenized text; without them vLLM skips detokenizing (faster). Every request gets
        # its own params object, so vLLM may skip deep-copying it (skip_clone): that copy was over a third of
        # add_request's time, which an oversubscribed round pays for every request it starts.
        self._make_params = lambda max_tokens, stop: SamplingParams(
            temperature=settings.temperature, max_tokens=max_tokens, logprobs=0, n=1,
            stop_token_ids=[settings.eos_token_id], stop=list(stop) or None, include_stop_str_in_output=True,
            detokenize=bool(stop), skip_special_tokens=False, output_kind=RequestOutputKind.DELTA, skip_clone=True)
        self._pending: dict[str, _Progress] = {}  # by request id
        self._by_engine_id: dict[str, _Progress] = {}  # by the id vLLM knows
        self._resumes = 0
        self.resumed_prefix_tokens = 0  # prompt + partial tokens prefilled again after weight updates
        self._asleep = False
        self._deferred: dict[str, torch.Tensor] | None = None  # weights pushed while asleep, loaded at waking
        self.sleeps = 0

    def rest(self) -> bool:
        """Free the GPU memory generation holds until the engine is next given requests (a flex worker about
        to train on the same GPU): vLLM's sleep mode, level 1 (weights offloaded to host memory, KV cache
        discarded), as verl's colocated engine does between rollouts.

        Only where vLLM has a sleep mode (CUDA, ROCm) and ``settings.sleep_mode`` asked for it, and only with
        nothing in flight; False otherwise (on the CPU a flex worker's engine just stops stepping). Weights
        pushed while it sleeps are loaded as it wakes (``_wake``), the newest only.
        """
        if not self._can_sleep or self._asleep or self._pending:
            return False
        self._llm.sleep(level=1)
        self._asleep = True
        self.sleeps += 1
        return True

    def _wake(self) -> None:
        """Weights back first, then the newest ones pushed meanwhile loaded over them, then the KV cache
        (verl's order: the cache is not allocated while two copies of the weights might be)."""
        self._llm.wake_up(tags=["weights"])
        if self._deferred is not None:
            self._reload(self._deferred)
            self._deferred = None
        self._llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    def submit(self, requests: Sequence[GenRequest]) -> None:
        if self._asleep and requests:
            self._wake()
        for req in requests:
            if req.request_id in self._pending:
                raise ValueError(f"request id {req.request_id!r} is already running")
            progress = _Progress(req, self.version)
            self._pending[req.request_id] = progress
            self._add(progress)

    def _add(self, progress: _Progress) -> None:
        """Hand vLLM the prompt plus what was generated so far, for the tokens still allowed."""
        from vllm.inputs import TokensPrompt

        req = progress.request
        self._by_engine_id[progress.engine_id] = progress
        self._engine.add_request(progress.engine_id,
                                 TokensPrompt(prompt_token_ids=list(req.prompt_tokens) + progress.tokens),
                                 self._make_params(req.max_tokens - len(progress.tokens), req.stop))

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        """Up to ``max_steps`` engine steps; the requests that finished in them.

        Outputs are deltas (new tokens of each running request per step), so
        every token is stamped with the version that sampled it.
        """
        done: list[GenResult] = []
        for _ in range(max_steps):
            if not self._engine.has_unfinished_requests():
                break
            for out in self._engine.step():
                progress = self._by_engine_id.get(out.request_id)
                if progress is None:
                    continue
                comp = out.outputs[0]
                tokens = list(comp.token_ids)
                progress.add(tokens, [entry[tok].logprob for entry, tok in zip(comp.logprobs or [], tokens)],
                             self.version)
                if out.finished:
                    del self._by_engine_id[out.request_id]
                    del self._pending[progress.request.request_id]
                    reason = comp.finish_reason if comp.finish_reason in ("stop", "length") else "abort"
                    done.append(progress.result(reason))
        return done

    def snapshot(self, request_ids: Sequence[str]) -> list[GenResult]:
        """What the named running requests have generated so far (finish reason ``abort``); they keep running.

        Copies: the requests go on appending to their own lists.
        """
        out = []
        for p in (self._pending[r] for r in request_ids if r in self._pending):
            out.append(GenResult(p.request.request_id, list(p.tokens), list(p.logprobs), "abort", list(p.versions),
                                 p.submitted_version))
        return out

    def abort(self, request_ids: Sequence[str]) -> list[GenResult]:
        """Stop the named requests; returns what each had generated (finish reason ``abort``)."""
        progress = [self._pending.pop(r) for r in request_ids if r in self._pending]
        if progress:
            self._engine.abort_request([p.engine_id for p in progress])
            for p in progress:
                self._by_engine_id.pop(p.engine_id, None)
        return [p.result("abort") for p in progress]

    def num_unfinished(self) -> int:
        return len(self._pending)

    def pending_ids(self) -> list[str]:
        return list(self._pending)

    def tokens_in_flight(self) -> int:
        """Tokens the unfinished requests have generated so far (resumed ones included)."""
        return sum(len(p.tokens) for p in self._pending.values())

    def warm_up(self) -> float:
        """Generate once on dummy prompts before any real request; returns the seconds it took.

        ``max_concurrent_sequences`` requests (prompts of 8 to 39 tokens,
        budgets of 8 to 64), so the engine steps through most batch sizes it
        will meet; then the prefix cache is reset. The warm-up draws from
        vLLM's generator, so later samples differ from a run without it.
        """
        start = time.perf_counter()
        vocab = max(4, self._llm.llm_engine.model_config.get_vocab_size())
        generate_all(self, [GenRequest(f"warm-up-{i}", [3 + (7 * i + j) % (vocab - 3) for j in range(8 + i % 32)],
                                       max_tokens=8 + 8 * (i % 8))
                            for i in range(self.settings.max_concurrent_sequences)])
        self._llm.reset_prefix_cache()
        return time.perf_counter() - start

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load ``state`` (Hugging Face names) into the running model, in place.

        Requests in flight are interrupted and resumed from where they
        stopped (prompt + tokens so far as the new prompt), as AReaL's
        interruptible generation does: their KV cache was computed with the
        old weights, so continuing on it would sample the next tokens from
        neither policy. The re-prefill makes every later token's log-prob
        exactly the new policy's; ``resumed_prefix_tokens`` counts what it
        prefills again.

        With ``settings.keep_kv_on_update`` (``rollout.kv_on_update =
        "keep"``) the weights change under the running requests instead, as
        PipelineRL's in-flight updates do: no abort, no re-prefill. Their
        later tokens are sampled by the new weights over keys and values the
        old ones computed; the log-prob stored with each is that of the
        distribution it was drawn from, so the trainer's importance ratio
        against it stays exact. The prefix cache is kept too (vLLM can only
        reset it with no request running).
        """
        if self._asleep:  # nothing in flight; loaded as it wakes
            self._deferred = state
            self.version = version
            return
        if self.settings.keep_kv_on_update:
            self._reload(state)
            self.version = version
            return
        running = list(self._pending.values())
        if running:
            self._engine.abort_request([p.engine_id for p in running])
            self._by_engine_id.clear()
        self._reload(state)
        self._llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.version = version
        self._resumes += 1
        for p in running:  # a running request is below its budget (vLLM finishes it on reaching it)
            p.engine_id = f"{p.request.request_id}#r{self._resumes}"
            self._add(p)
            self.resumed_prefix_tokens += len(p.request.prompt_tokens) + len(p.tokens)

    def _reload(self, state: dict[str, torch.Tensor]) -> None:
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()),
                                                           "is_checkpoint_format": True})
