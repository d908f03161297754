"""The one configuration tree of a reflow run.

Experiments are short TOML files under ``configs/``; every field has a
default, a description and bounds, so an empty file is a valid run (the
embedded CPU default. ``config.load`` reads files and overrides into it;
``config.reference`` renders it as docs/configuration.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        """``total_steps = true`` is a mistake, not 1: pydantic would take a boolean for a number."""
        for name, value in data.items() if isinstance(data, dict) else ():
            field = cls.model_fields.get(name)
            types = _types(field.annotation) if field is not None and isinstance(value, bool) else set()
            if types & {int, float} and bool not in types:
                raise ValueError(f"{name}: expected a number, got {str(value).lower()}")
        return data


def _types(annotation: Any) -> set[Any]:
    """The types a field's annotation admits (a union's members)."""
    return set(get_args(annotation)) if get_origin(annotation) in (Union, UnionType) else {annotation}


class RunConfig(_Section):
    name: str = Field("default", min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Run name; the run directory is run.out_dir/NAME-TIMESTAMP.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for prompts, sampling and init.")
    out_dir: str = Field("runs", min_length=1, description="Directory that holds run directories.")
    total_steps: int = Field(100, ge=1, le=1_000_000, description="Trainer updates to run.")
    max_new_groups: int = Field(0, ge=0, le=1_000_000_000, description="End the run once this many prompt groups "
                                "have been trained on for the first time (0: no such limit; total_steps still "
                                "ends it). Every batch of sync, one_step_off and async holds prompts_per_step new "
                                "groups; reflow tops its batches up with replayed groups, so it needs more steps for "
                                "the same data. `reflow bench` gives every mode the same budget.")
    checkpoint_every_steps: int = Field(20, ge=1, le=1_000_000,
                                        description="Save model + optimizer every N steps (and at the end).")


class TinyModelConfig(_Section):
    """Shape and warm-start of the built-in tiny Qwen3-architecture policy."""

    hidden_size: int = Field(128, ge=16, le=1024, description="Model width.")
    num_layers: int = Field(4, ge=1, le=16, description="Decoder layers.")
    num_heads: int = Field(2, ge=1, le=32, description="Attention heads (head_dim = hidden/heads; few wide "
                                                       "heads learn the copy-from-prompt skill sooner).")
    num_kv_heads: int = Field(2, ge=1, le=32, description="Key/value heads (GQA; equal to num_heads: none).")
    intermediate_size: int = Field(384, ge=16, le=4096, description="MLP width.")
    max_position_embeddings: int = Field(512, ge=64, le=8192, description="Longest sequence in tokens.")
    sft_steps: int = Field(1600, ge=0, le=100_000, description="Supervised warm-start steps on reference solutions.")
    sft_examples_per_step: int = Field(16, ge=1, le=1024, description="Reference solutions per SFT step (small "
                                                                     "batches, many steps: faster on CPU).")
    sft_learning_rate: float = Field(3e-3, gt=0, le=1.0, description="Peak SFT learning rate (AdamW, cosine).")
    sft_answer_noise: float = Field(0.45, ge=0, lt=0.5, description="Share of SFT references whose answer line is "
                                    "off by a little (the steps stay right). The warm-started policy then "
                                    "samples a wrong answer about this often while greedy decoding stays "
                                    "right: an error RL can remove. 0: clean references.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError("model.tiny.hidden_size must be a multiple of model.tiny.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.tiny.num_heads must be a multiple of model.tiny.num_kv_heads")
        return self


class ModelConfig(_Section):
    path: str | None = Field(None, min_length=1, description="A Hugging Face model directory, or a Hub id ('org/name', "
                             "'org/name@revision') that the local Hugging Face cache holds (nothing is downloaded). "
                             "Unset: build (or reuse from cache) the tiny warm-started policy.")
    cache_dir: str = Field(".cache/reflow/models", min_length=1, description="Where built tiny models are cached, "
                                                               "keyed by a hash of their inputs.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Weights dtype for training and generation.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)


class EnvConfig(_Section):
    kind: Literal["arith", "math", "code", "tool_calc", "custom"] = Field(
        "arith", description="Workload: prompts + verifiable reward. 'arith': synthetic sums (CPU default); 'math': "
        "DAPO-Math-17K / verl-style rows, \\boxed{} answers checked by math-verify; 'code': APPS-style rows, "
        "programs run in a sandbox against the tests. math and code use a small synthetic dataset in the same "
        "format unless env.data_path is set. 'tool_calc': products of 3-4 digit numbers (operands "
        "100..max_operand) solved with a code tool call; needs tools.max_calls >= 1. 'custom': the rows of "
        "env.data_path scored by env.reward_function (docs/workloads.md).")
    reward_function: str | None = Field(None, max_length=4096, description="custom: the reward, as "
                                        "'path/to/file.py:function' or 'package.module:function'; called as "
                                        "function(prompt, response, answer) -> reward, bool or (reward, correct).")
    reward_batched: bool = Field(False, description="custom: call env.reward_function once per batch with lists "
                                 "of prompts, responses and answers (it returns a list).")
    min_terms: int = Field(2, ge=2, le=64, description="arith: fewest numbers in a sum.")
    max_terms: int = Field(24, ge=2, le=64, description="arith: most numbers in a sum.")
    long_share: float = Field(0.4, ge=0, le=1, description="arith: share of sums longer than min_terms "
                                                          "(the rest have exactly min_terms terms).")
    tail_p: float = Field(0.3, gt=0, lt=1, description="arith: a long sum has min_terms + 1 + Geometric(tail_p) "
                                                       "terms; smaller means a longer tail.")
    max_operand: int = Field(20, ge=9, le=9999, description="arith: largest operand (operands are 1..max); "
                                                            "math, code synthetic: largest number in a problem; "
                                                            "tool_calc: operands are 100..max.")
    format_reward: float = Field(0.0, ge=0, le=1, description="Reward for a well-formed answer line that is wrong.")
    eval_prompts: int = Field(128, ge=0, le=100_000, description="Held-out prompts for evaluation (0: none).")
    data_path: str | None = Field(None, min_length=1, max_length=4096, description="math, code, custom: the dataset (a "
                                  ".parquet or .jsonl file, or a directory saved by datasets' save_to_disk, whose "
                                  "'train' split a DatasetDict gives); math: verl/DAPO rows or question/answer rows; "
                                  "code: APPS rows). "
                                  "Unset: the built-in synthetic dataset (with reference solutions for the tiny "
                                  "policy's warm start).")
    data_format: Literal["auto", "parquet", "jsonl", "hf_dataset"] = Field(
        "auto", description="math, code, custom: format of data_path and eval_data_path ('auto': by suffix, or "
        "'hf_dataset' for a save_to_disk directory).")
    eval_data_path: str | None = Field(None, min_length=1, max_length=4096, description="math, code, custom: a "
                                       "separate eval file; unset: eval rows are held out of data_path "
                                       "(eval_holdout_share).")
    eval_holdout_share: float = Field(0.05, ge=0, le=0.5, description="math, code, custom: share of data_path "
                                      "rows held out for eval (chosen by a hash of the row's content, "
                                      "seed-independent) "
                                      "when eval_data_path is unset.")
    max_prompt_tokens: int = Field(1024, ge=16, le=131_072, description="math, code, custom: rows whose rendered "
                                   "prompt is longer (in the model's tokens) are dropped (256 when the tiny default "
                                   "policy trains math or code and this is unset).")
    code_test_seconds: float = Field(5.0, gt=0, le=120, description="code: wall-clock limit of one test run "
                                     "(CPU limit: the same, at most 10 s).")
    code_memory_mb: int = Field(256, ge=32, le=65_536, description="code: address-space limit of a test run.")
    code_stop_after: Literal["timeout", "failure", "never"] = Field(
        "timeout", description="code: skip a program's remaining tests (counted as failed) after its first test "
        "that times out ('timeout': a program that loops forever costs one time limit, not one per test, and "
        "scores 0 either way), after its first failed test ('failure': cheapest; changes the pass-rate reward "
        "of a program that would pass later tests), or never.")
    code_max_tests: int = Field(16, ge=1, le=10_000, description="code: at most this many tests per problem "
                                "(the first ones) are run.")
    code_score_tasks: int = Field(4, ge=1, le=1024, description="code: parallel scoring tasks per batch (Ray "
                                  "tasks in a run, threads without Ray).")
    code_score_cpus: float = Field(0.25, ge=0, le=64, description="code: CPUs each Ray scoring task reserves "
                                   "(0 when the actors hold every CPU of the cluster, so scoring never waits).")

    @model_validator(mode="after")
    def _terms_ordered(self) -> "EnvConfig":
        if self.min_terms > self.max_terms:
            raise ValueError("env.min_terms must be <= env.max_terms")
        if self.kind == "custom" and (self.reward_function is None or self.data_path is None):
            raise ValueError("env.kind = 'custom' needs env.reward_function ('file.py:function') and env.data_path "
                             "(the prompts)")
        if self.kind != "custom" and self.reward_function is not None:
            raise ValueError(f"env.reward_function applies to env.kind = 'custom', not {self.kind!r}")
        if self.kind == "arith" and (self.data_path or self.eval_data_path):
            raise ValueError("env.data_path / env.eval_data_path apply to env.kind 'math', 'code' or 'custom', "
                             "not 'arith'")
        if self.eval_data_path and not self.data_path:
            raise ValueError("env.eval_data_path needs env.data_path (the synthetic dataset has its own eval split)")
        for name in ("data_path", "eval_data_path"):
            path = getattr(self, name)
            if path and self.data_format == "auto" and dataset_format(path) is None:
                raise ValueError(f"env.{name}: cannot tell the format of {path!r} from its suffix; use .parquet "
                                 "or .jsonl, a directory saved by datasets' save_to_disk, or set env.data_format")
        return self


SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # what datasets' save_to_disk writes (Dataset, DatasetDict)


def dataset_format(path: str, declared: str = "auto") -> Literal["parquet", "jsonl", "hf_dataset"] | None:
    """The format of a dataset: ``declared`` unless 'auto', else by suffix or a save_to_disk directory (None:
    unknown)."""
    if declared in ("parquet", "jsonl", "hf_dataset"):
        return declared  # type: ignore[return-value]
    if any((Path(path) / name).is_file() for name in SAVED_DATASET_FILES):
        return "hf_dataset"
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".json")):
        return "jsonl"
    return None


class RolloutConfig(_Section):
    engine: Literal["vllm", "transformers"] = Field("vllm", description="Generation backend.")
    prompts_per_step: int = Field(32, ge=1, le=65_536, description="Distinct prompts per update.")
    samples_per_prompt: int = Field(8, ge=1, le=1024, description="Responses per prompt (the GRPO group); at "
                                    "least 2.")
    max_response_tokens: int = Field(192, ge=1, le=131_072, description="Longest response in tokens.")
    temperature: float = Field(1.0, gt=0, le=5.0, description="Sampling temperature (1.0 keeps the "
                                                              "behaviour log-probs exact).")
    max_concurrent_sequences: int = Field(256, ge=1, le=65_536, description="Engine's max running sequences.")
    kv_cache_gib: int = Field(1, ge=1, le=1024, description="vLLM CPU KV-cache size in GiB "
                                                         "(VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="vLLM on a GPU: the share of the "
                                          "engine's GPU it takes for weights and KV cache (vLLM's "
                                          "gpu_memory_utilization; the CPU build ignores it). Flex workers use "
                                          "pool.gpu_memory_utilization.")
    scheduling: Literal["plain", "sorted_on_policy", "sorted_partial"] = Field(
        "plain", description="Length-aware rounds (SortedRL; mode sync): 'plain' generates exactly one batch per "
        "round; 'sorted_on_policy' oversubscribes the engine, ends the round once one batch of groups is done, "
        "trains the shortest groups first and drops unfinished ones (prompts re-queued); 'sorted_partial' keeps "
        "unfinished responses in the rollout cache and resumes them next round, each token keeping its own "
        "log-prob and version. The streaming modes always resume partial responses across updates: in async "
        "and reflow 'sorted_partial' is accepted and runs as 'plain' (no rounds); other pairs need mode sync.")
    oversubscription: float = Field(4.0, ge=1.0, le=16.0, description="Sorted rounds: groups open at once (cached "
                                    "ones included) as a multiple of prompts_per_step; their requests queue, cached "
                                    "work first, and start as engine slots free, so unused ones cost nothing.")
    early_stop: Literal["groups", "tokens"] = Field(
        "groups", description="Sorted rounds end when prompts_per_step groups are complete ('groups') or when "
        "round_tokens tokens were generated with at least one group complete ('tokens').")
    round_tokens: int = Field(0, ge=0, le=100_000_000, description="Sorted rounds with early_stop='tokens': "
                              "tokens per round.")
    max_aborts: int = Field(2, ge=1, le=100, description="Sorted rounds: sorted_on_policy pins a prompt left "
                            "incomplete this many rounds (the next round waits for it); sorted_partial trains a "
                            "complete group that waited this many rounds before shorter ones. No prompt starves.")
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute", description="vLLM, requests in flight when new weights arrive (streaming modes, and the "
        "unfinished responses a SortedRL round leaves for the next): 'recompute' interrupts them and prefills "
        "prompt + partial response again on the new weights (AReaL's interruptible generation; every later "
        "token is the new policy's exactly); 'keep' swaps the weights under them and keeps their KV cache from "
        "the old weights (PipelineRL's in-flight update: no re-prefill; later tokens are sampled by the new "
        "weights over old keys and values, and their stored log-probs are those of that sampling, so the "
        "off-policy correction stays exact).")
    enforce_eager: bool = Field(True, description="vLLM: skip torch.compile (starts in seconds; for tiny "
                                                     "models on CPU eager decoding was as fast as compiled). The "
                                                     "workers then compile nothing (TORCHDYNAMO_DISABLE): vLLM's "
                                                     "small compiled sampler helpers run eagerly.")
    warm_up: bool = Field(
        True, description="vLLM: each engine generates once on dummy prompts as it starts, before the run's "
        "clock (the first rollout was a third as fast as the next ones on the CPU).")
    cpu_linear: Literal["torch", "onednn"] = Field(
        "torch", description="vLLM on the CPU: the matmul behind every linear layer. 'torch' is torch's own "
        "(MKL); 'onednn' is vLLM's default, a oneDNN kernel built per layer for each new token count and kept in "
        "a cache of 32 per layer: the token count of a step changes with every batch, so a streaming round "
        "builds kernels over and over (docs/operations.md \"Memory on this machine\"). No effect on the GPU.")

    @field_validator("samples_per_prompt")
    @classmethod
    def _groups_of_two(cls, n: int) -> int:
        if n < 2:
            raise ValueError("must be at least 2: a GRPO group of one sample has advantage 0 (its reward "
                             "minus its group's mean), so it would train on nothing")
        return n


class TrainConfig(_Section):
    learning_rate: float = Field(3e-4, gt=0, le=1.0, description="AdamW learning rate (constant); above ~1e-3 "
                                                                "the tiny default policy collapses.")
    weight_decay: float = Field(0.0, ge=0, le=1.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm.")
    micro_batch_tokens: int = Field(8192, ge=64, le=10_000_000, description="Token budget of one micro-batch "
                                                                           "(prompt + response, padded).")
    clip_eps_low: float = Field(0.2, ge=0, le=1.0, description="PPO ratio clip below 1.")
    clip_eps_high: float = Field(0.28, ge=0, le=10.0, description="PPO ratio clip above 1 (DAPO clip-higher).")
    kl_coef: float = Field(0.0, ge=0, le=10.0, description="Weight of the k3 KL to the initial policy (0: off, "
                                                           "no reference model is kept).")
    loss_agg: Literal["token_mean", "seq_mean"] = Field("token_mean", description="Loss aggregation over "
                                                                                  "tokens of a batch.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Trainer device.")
    advantage_std: Literal["population", "unbiased"] = Field(
        "population", description="grpo: the group's std that advantages are divided by: 'population' "
        "(sqrt(sum (r - mean)^2 / n)) or 'unbiased' (sqrt(sum (r - mean)^2 / (n - 1)), verl's); unbiased "
        "advantages are sqrt((n - 1) / n) times the population ones.")
    clip_ratio_c: float | None = Field(None, gt=1.0, le=100.0, description="Dual clip (verl's clip_ratio_c; "
                                       "verl's default 3): for a negative advantage A the per-token loss is at "
                                       "most -clip_ratio_c * A. Unset: off.")
    advantage_estimator: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="How rewards become advantages within a GRPO group (``policies.losses``): 'grpo' "
        "centres by the group mean and divides by its std (advantage_std); 'dr_grpo' only centres (Dr. GRPO).")
    policy_loss: Literal["decoupled", "ppo"] = Field(
        "decoupled", description="decoupled: AReaL's decoupled PPO with the pre-update weights as the proximal "
        "policy and a capped behaviour weight per token (corrects stale and replayed tokens; default); ppo: the "
        "clipped surrogate against the behaviour log-probs (verl's bypass_mode, as its one-step-off recipe "
        "sets it; verl's default clips against log-probs the trainer recomputes).")
    is_weight_cap: float = Field(2.0, gt=0, le=100.0, description="decoupled: largest behaviour importance "
                                 "weight exp(proximal - behaviour), per token or sequence as is_level says.")
    skip_zero_advantage: bool = Field(
        True, description="Skip forward and backward of samples whose gradient is exactly zero: advantage 0 "
        "(a GRPO group whose rewards are all equal) or loss weight 0, when kl_coef is 0. Their tokens still "
        "count in the loss normaliser, so the update is the same; only the time differs.")
    warm_up: bool = Field(
        True, description="Before the run's clock starts, run forward and backward once per padded length "
        "class at the full micro-batch budget on dummy data (weights, optimiser and RNG untouched), so the "
        "trainer process holds its peak memory before the first step (docs/operations.md \"Memory on this machine\").")
    lr_by_weight: bool = Field(
        True, description="Scale each step's learning rate by the mean loss weight of the samples it trains on "
        "(those with a gradient). AdamW normalises the gradient's scale, so loss weights alone only re-balance "
        "samples within a batch: a batch of down-weighted replayed samples still moves the weights a full step. "
        "With this on (default) it moves them by its mean weight; off: every step at the full rate, whatever its "
        "weights (reflow's behaviour before this option existed; docs/concepts.md \"The loss\").")
    is_cap_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="decoupled: above the cap, truncate the weight (TIS) or drop the token or "
        "sequence (mask: MIS, AReaL's code).")
    is_level: Literal["token", "sequence", "geometric"] = Field(
        "geometric", description="decoupled: the behaviour importance weight per token, or per sequence as "
        "verl's rollout correction offers it: 'sequence' exp(sum of the token log-ratios), 'geometric' exp(their "
        "mean) (default: reflow's median data factor against sync 1.58, per token 1.33, on the data-efficiency "
        "seeds; docs/benchmark.md, 'Data efficiency', its tables in docs/measurements.md).")
    minibatches_per_step: int = Field(
        1, ge=1, le=64, description="Optimiser steps per batch (PPO minibatches, split by tokens). Above 1 the "
        "trainer first recomputes the batch's log-probs under the step's starting weights, the proximal policy "
        "the decoupled loss clips against (one more forward pass per step); still one weight version per batch.")


class ToolsConfig(_Section):
    """Multi-turn tool use (ReTool-style): the policy's code blocks run in the sandbox between turns."""

    max_calls: int = Field(0, ge=0, le=64, description="Most tool calls per response (0: single-turn, no "
                           "tools). Generation stops after each code block's closing tag; the block runs and "
                           "its output is appended inside an output tag pair (masked out of the loss).")
    max_output_chars: int = Field(256, ge=8, le=65_536, description="Tool output kept per call (longer output "
                                  "is cut and ends with '...'); it counts against rollout.max_response_tokens.")
    timeout_s: float = Field(5.0, gt=0, le=600, description="CPU-time limit of one call (wall clock: 1 s more).")
    cpus_per_call: float = Field(0.0, ge=0, le=64, description="CPUs Ray reserves per tool-call task (0: none; "
                                 "the sandbox limits each call's CPU time itself).")
    max_concurrent_calls: int = Field(4, ge=1, le=4096, description="Tool calls running at once per engine "
                                      "(more wait in a queue; generation of other requests goes on).")


ModeKind = Literal["sync", "one_step_off", "async", "reflow"]
MODE_KINDS: tuple[str, ...] = get_args(ModeKind)


class ModeConfig(_Section):
    kind: ModeKind = Field(
        "sync", description="Orchestration mode: 'sync' generates the whole batch, then trains (verl's default); "
                            "'one_step_off' generates batch k+1 while training on batch k (staleness 1); "
                            "'async' streams rollouts into the buffer and trains on whatever is ready within "
                            "buffer.max_staleness_versions (verl fully-async / AReaL); 'reflow' is async plus "
                            "replay from the buffer when fresh data is short.")


class BufferConfig(_Section):
    """The staleness-bounded replay buffer over Delta (modes async and reflow)."""

    max_staleness_versions: int = Field(2, ge=0, le=1000, description="Trainer version minus the version that "
                                        "generated a sample's oldest token never exceeds this. An integer, or a "
                                        "table by mode that names all four (`{sync = 8, one_step_off = 8, async = 4, "
                                        "reflow = 8}`): the run takes its mode's entry.")
    replay_ratio: float = Field(0.5, ge=0, le=0.95, description="reflow: largest share of a batch, in samples, "
                                "taken from already-trained trajectories (async always uses 0).")
    max_reuse: int = Field(2, ge=1, le=100, description="reflow: most times one trajectory is trained on "
                           "(1: never replayed).")
    replay_order: Literal["newest", "advantage", "signal"] = Field(
        "advantage", description="reflow: which replayed groups go first: 'advantage' (largest spread first: the "
        "variance of the group's rewards; groups with equal rewards carry no gradient), 'signal' (that spread "
        "times the weight the "
        "replay would get from reuse_decay and staleness_decay; groups with no spread are never replayed) or "
        "'newest'.")
    reuse_decay: float = Field(0.5, gt=0, le=1, description="Loss weight factor per previous use of a sample.")
    staleness_decay: float = Field(0.9, gt=0, le=1, description="Loss weight factor per version of age (async "
                                   "and reflow; with train.lr_by_weight it also scales the step: async's samples, "
                                   "about one version old, step at about 0.93 of the rate; 1.0 measured worse on "
                                   "the data-efficiency seeds: docs/benchmark.md, 'Data efficiency').")
    select_ahead: bool = Field(True, description="reflow: choose the next batch while the trainer computes the "
                               "current one, for the version it will train at, so the trainer starts it as soon "
                               "as the weights are pushed (async, like verl's fully-async trainer, selects after "
                               "each step; at max_staleness_versions = 0 no batch can be chosen before its weights "
                               "exist).")
    drain_window_s: float = Field(0.25, gt=0, le=60, description="Engine stepping window between feeder "
                                  "decisions (weights load between windows).")


class ConcurrencyConfig(_Section):
    """Adaptive in-flight generation requests per engine (streaming modes; AIMD on tokens/s)."""

    adaptive: bool = Field(True, description="Adapt the target during the run (else keep initial_sequences).")
    initial_sequences: int = Field(128, ge=1, le=65_536, description="In-flight requests at start.")
    min_sequences: int = Field(32, ge=1, le=65_536, description="Lower bound of the target.")
    increase: int = Field(32, ge=1, le=65_536, description="Additive step when throughput rose.")
    decrease: float = Field(0.75, gt=0, lt=1, description="Multiplicative factor when throughput fell.")
    window_s: float = Field(2.0, gt=0, le=600, description="Engine-busy seconds per decision.")


class ResourcesConfig(_Section):
    ray_address: str | None = Field(None, min_length=1, description="Ray cluster address; unset: RAY_ADDRESS if "
                                    "set, else a local Ray of the run's own (even where a ray start cluster runs).")
    num_cpus: int | None = Field(None, ge=1, le=100_000, description="CPUs for a local Ray (unset: all).")
    engine_cpus: float = Field(1.0, gt=0, le=1024, description="CPUs reserved per engine actor.")
    trainer_cpus: float = Field(1.0, gt=0, le=1024, description="CPUs reserved per trainer actor.")
    engines: int = Field(1, ge=1, le=1024, description="Engine actors generating in data parallel, each "
                         "reserving engine_cpus and engine_gpus: streaming modes deal each group to the engine "
                         "with the most room below its own concurrency target (one controller per engine), plain "
                         "rounds split a round's groups across them, sorted rounds give the group at stream "
                         "position g to engine g mod engines.")
    engine_placement: Literal["spread", "pack"] = Field("spread", description="How the engines' placement group "
                                                        "lays them over the cluster's nodes when engines > 1: "
                                                        "spread (one per node where possible) or pack.")
    flex_workers: int = Field(0, ge=0, le=64, description="The elastic pool: actors that hold the model once as "
                              "an engine and once as a trainer module, and either generate or compute gradients "
                              "for the trainer's step (the optimiser state stays with the trainer; each reserves "
                              "engine_cpus and engine_gpus). async and reflow move them with the stage-speed "
                              "scheduler ([pool]); sync has them generate in every rollout and train in every "
                              "update (verl's colocated hybrid engine); one_step_off has them train only (its "
                              "rollout overlaps the update). Needs trainer_ranks = 1.")
    flex_cpus: float = Field(1.0, ge=0, le=1024, description="CPUs reserved per flex worker (0: it shares the "
                             "cores the engines and the trainer reserve, as on a two-core machine).")
    trainer_ranks: int = Field(1, ge=1, le=1024, description="Trainer actors forming one torch.distributed "
                               "group (gloo on CPU, NCCL on GPU) with FSDP2: each trains on its token-balanced "
                               "share of the batch; each reserves trainer_cpus and trainer_gpus. More than one: a "
                               "dead rank fails the run (reflow resume continues it on as many ranks).")
    trainer_placement: Literal["pack", "spread"] = Field("pack", description="How the trainer ranks' placement "
                                                         "group lays them over the cluster's nodes: pack (as few "
                                                         "nodes as fit) or spread (one per node where possible).")
    engine_gpus: float = Field(0.0, ge=0, le=64, description="GPUs per engine actor.")
    weight_sync: Literal["object_store", "broadcast"] = Field(
        "object_store", description="How new weights reach the engines: 'object_store' (the trainer's copy enters "
        "Ray's object store once and every engine loads that reference) or 'broadcast' (the trainer's rank 0 "
        "broadcasts each tensor to every engine over a process group of their own, as verl and OpenRLHF do: NCCL "
        "when the engines and the trainer are on GPUs, else gloo). A group cannot take a new member: with "
        "'broadcast' an engine restarted by Ray fails the next sync and the run (reflow resume continues it).")
    trainer_gpus: float = Field(0.0, ge=0, le=64, description="GPUs per trainer actor.")
    torch_threads: int = Field(2, ge=1, le=256, description="torch intra-op threads per actor and of the tiny "
                                                            "model's warm start (1 on a busy machine).")
    max_actor_restarts: int = Field(3, ge=0, le=1000, description="Times Ray restarts an engine or trainer "
                                    "actor whose process died (its calls in flight are re-issued); 0: a dead "
                                    "actor fails the run.")

    @property
    def engine_actors(self) -> int:
        """Every actor that generates: the engines, then the flex workers."""
        return self.engines + self.flex_workers

    @property
    def flex_indices(self) -> range:
        """Positions of the flex workers among the engine actors (``engine_actors``)."""
        return range(self.engines, self.engine_actors)


class PoolConfig(_Section):
    """The stage-speed scheduler of the flex workers (``control.roles``), streaming modes."""

    low_batches: float = Field(0.5, ge=0, le=1000, description="Below this many batches of admissible unused "
                               "groups, and falling, a training flex worker moves to generation.")
    high_batches: float = Field(1.5, gt=0, le=1000, description="Above this many, and rising, a generating flex "
                                "worker moves to training; must sit below max(buffer.max_staleness_versions, 1) "
                                "batches, the most the staleness gate lets wait.")
    dwell_s: float = Field(30.0, gt=0, le=86_400, description="A worker keeps its role at least this long, and the "
                           "pool switches at most once per dwell.")
    window_s: float = Field(5.0, gt=0, le=3600, description="Seconds of measured rates per decision.")
    max_moves: int = Field(1, ge=1, le=1024, description="Flex workers one decision may move. 1: at most one "
                           "switch per dwell_s; more: as many as close the measured wait of the faster stage, up "
                           "to this (for a large pool, where one per dwell follows a change too slowly).")
    switch_estimate_s: float = Field(1.0, ge=0, le=3600, description="Cost of a switch assumed until one is "
                                     "measured (a switch must win back more than it costs over a dwell).")
    in_flight: Literal["move", "finish"] = Field("move", description="What a worker moving to training does "
                                                 "with the requests it runs. move: gives them back at once, each "
                                                 "resumed on a generating engine from where it stopped (its tokens "
                                                 "keep their versions and log-probs; the prompt and partial "
                                                 "response are prefilled again); finish: runs them to their end "
                                                 "first (the switch waits for its longest request).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1.0, description="vLLM on a GPU: the share of its GPU a "
                                          "flex worker's engine takes; the rest holds its trainer module (verl's "
                                          "colocated rollout defaults to 0.5). The engine sleeps (vLLM's sleep "
                                          "mode, level 1) while the worker trains.")
    initial_role: Literal["generate", "train"] = Field("generate", description="Every flex worker's role at the "
                                                       "start.")
    policy: Literal["stage_speed", "alternate"] = Field("stage_speed", description="stage_speed: the band rule "
                                                        "(control.roles); alternate: one worker takes the other "
                                                        "role every dwell_s, whatever the rates (to measure what "
                                                        "a switch costs; not a way to run).")


class TrackingConfig(_Section):
    tracking_uri: str | None = Field(None, min_length=1, description="MLflow tracking URI; unset uses a local sqlite "
                                                       "store under out_dir.")
    experiment: str = Field("reflow", min_length=1, description="MLflow experiment name.")


class StorageConfig(_Section):
    root: str | None = Field(None, min_length=1, description="Where the Delta tables live (local path or s3://, gs://, "
                                               "az:// URI); unset: the run directory's tables/ folder.")


class EvalConfig(_Section):
    every_steps: int = Field(10, ge=1, le=1_000_000, description="Evaluate on held-out prompts every N steps.")
    samples_per_prompt: int = Field(4, ge=1, le=64, description="Samples per held-out prompt, drawn "
                                    "at rollout.temperature (never greedy; more: less noise).")
    deferred: bool = Field(False, description="Snapshot the weights at each eval point and evaluate after "
                           "training, so evaluation never enters the training clock (always on in the "
                           "streaming modes, whose engine is busy with training requests).")


# What a workload needs that the generic defaults do not give it, for the fields a config leaves unset:
# (section, field) -> value. Dataset prompts on the tiny policy (512 positions, 192 response tokens by default)
# must fit beside the response; tool_calc needs tool calls and operands of three digits or more.
WORKLOAD_DEFAULTS: dict[str, dict[tuple[str, str], Any]] = {
    "math": {("env", "max_prompt_tokens"): 256},
    "code": {("env", "max_prompt_tokens"): 256},
    "tool_calc": {("env", "max_operand"): 999, ("tools", "max_calls"): 2},
}


class ReflowConfig(_Section):
    """The whole tree. Sections mirror the system's parts."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    mode: ModeConfig = Field(default_factory=ModeConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="before")
    @classmethod
    def _workload_defaults(cls, data: Any) -> Any:
        """Give the fields a workload needs, and the config leaves unset, that workload's defaults
        (``WORKLOAD_DEFAULTS``), so ``--set env.kind=math`` alone is a valid run."""
        if not isinstance(data, dict) or not isinstance(data.get("env"), dict):
            return data
        kind, model = data["env"].get("kind"), data.get("model") or {}
        if not isinstance(kind, str) or not isinstance(model, dict):
            return data  # the field checks of env.kind and model name the wrong type
        tiny = model.get("path") is None
        out = {**data}
        for (section, key), value in WORKLOAD_DEFAULTS.get(kind, {}).items():
            if key == "max_prompt_tokens" and not tiny:
                continue  # a real model's prompts: the generic default
            given = out.get(section)
            if isinstance(given, dict) and key in given:
                continue
            out[section] = {**(given or {}), key: value}
        return out

    @model_validator(mode="before")
    @classmethod
    def _staleness_by_mode(cls, data: Any) -> Any:
        """``buffer.max_staleness_versions`` given as a table by mode: the entry of the run's mode (a bench runs
        every mode from one file, and the bound that measured best differs by mode: docs/benchmark.md, "Data
        efficiency")."""
        buffer = data.get("buffer") if isinstance(data, dict) else None
        table = buffer.get("max_staleness_versions") if isinstance(buffer, dict) else None
        if not isinstance(table, dict):
            return data
        field = "buffer.max_staleness_versions"
        unknown = sorted(set(table) - set(MODE_KINDS))
        if unknown:
            raise ValueError(f"{field}: unknown mode {unknown[0]!r} in the table (modes: {', '.join(MODE_KINDS)})")
        missing = [m for m in MODE_KINDS if m not in table]
        if missing:
            raise ValueError(f"{field}: the table has no entry for {', '.join(missing)} (give all four modes, or "
                             "one integer for every mode)")
        for mode, value in table.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
                raise ValueError(f"{field}.{mode}: expected an integer from 0 to 1000 (got {value!r})")
        mode = data.get("mode") or {}
        kind = mode.get("kind", ModeConfig.model_fields["kind"].default) if isinstance(mode, dict) else None
        if not isinstance(kind, str) or kind not in table:
            return data  # an unknown mode or a wrong type: the field check of mode.kind names it
        return {**data, "buffer": {**buffer, "max_staleness_versions": table[kind]}}

    @model_validator(mode="after")
    def _cross_checks(self) -> "ReflowConfig":
        if self.model.path is None:
            if self.env.data_path is not None:
                raise ValueError("env.data_path: a dataset file has no reference solutions to warm-start the tiny "
                                 "policy on; set model.path to a Hugging Face model directory (or unset "
                                 "env.data_path for the synthetic dataset)")
            if self.env.kind == "arith":
                longest_prompt, what = 8 + 6 * self.env.max_terms, "the longest arith prompt"
            elif self.env.kind == "tool_calc":
                longest_prompt, what = 2 + 2 * len(str(self.env.max_operand)), "the longest tool_calc prompt"
            else:
                longest_prompt, what = self.env.max_prompt_tokens, "env.max_prompt_tokens"
            if longest_prompt + self.rollout.max_response_tokens > self.model.tiny.max_position_embeddings:
                raise ValueError(
                    f"rollout.max_response_tokens plus {what} "
                    f"({longest_prompt} tokens) exceeds model.tiny.max_position_embeddings "
                    f"({self.model.tiny.max_position_embeddings}); lower one or raise the other")
        r = self.rollout
        if r.scheduling != "plain" and self.mode.kind != "sync":
            if not (r.scheduling == "sorted_partial" and self.mode.kind in ("async", "reflow")):
                raise ValueError(f"rollout.scheduling={r.scheduling!r} needs mode.kind='sync' (the streaming modes "
                                 "already resume partial responses across updates: use 'sorted_partial' or 'plain' "
                                 "there)")
        res, pool = self.resources, self.pool
        if res.flex_workers and res.trainer_ranks > 1:
            raise ValueError(f"resources.flex_workers > 0 needs resources.trainer_ranks = 1 (a flex worker adds its "
                             f"gradients to one trainer's; got trainer_ranks={res.trainer_ranks})")
        if res.flex_workers and r.scheduling != "plain" and self.mode.kind == "sync":
            raise ValueError(f"resources.flex_workers > 0 needs rollout.scheduling='plain' in mode 'sync' (a sorted "
                             f"round runs on the main engines only; got {r.scheduling!r})")
        if not pool.low_batches < pool.high_batches:
            raise ValueError(f"pool.low_batches ({pool.low_batches}) must be below pool.high_batches "
                             f"({pool.high_batches})")
        gate = max(self.buffer.max_staleness_versions, 1)
        if res.flex_workers and self.mode.kind in ("async", "reflow") and pool.high_batches >= gate:
            raise ValueError(f"pool.high_batches ({pool.high_batches}) must be below max(buffer."
                             f"max_staleness_versions, 1) = {gate} batches: the staleness gate never lets more "
                             f"unused groups wait, so no flex worker would ever move to training")
        if self.env.kind == "tool_calc" and self.tools.max_calls == 0:
            raise ValueError("env.kind='tool_calc' needs tool calls: set tools.max_calls >= 1")
        if self.env.kind == "tool_calc" and self.env.max_operand < 100:
            raise ValueError("env.kind='tool_calc' draws operands from 100..env.max_operand: set env.max_operand "
                             ">= 100")
        if self.tools.max_calls and r.scheduling != "plain":
            raise ValueError(f"tools.max_calls > 0 needs rollout.scheduling='plain' (sorted rounds do not keep "
                             f"the turn structure of cached partial responses; got {r.scheduling!r})")
        if r.scheduling != "plain" and r.early_stop == "tokens" and r.round_tokens == 0:
            raise ValueError("rollout.early_stop='tokens' needs rollout.round_tokens > 0")
        c = self.concurrency
        if not c.min_sequences <= c.initial_sequences <= self.rollout.max_concurrent_sequences:
            raise ValueError(f"need concurrency.min_sequences ({c.min_sequences}) <= concurrency.initial_sequences "
                             f"({c.initial_sequences}) <= rollout.max_concurrent_sequences "
                             f"({self.rollout.max_concurrent_sequences})")
        if c.min_sequences < self.rollout.samples_per_prompt:
            raise ValueError(f"concurrency.min_sequences ({c.min_sequences}) must hold one whole group "
                             f"(rollout.samples_per_prompt = {self.rollout.samples_per_prompt})")
        if self.rollout.prompts_per_step * self.rollout.samples_per_prompt > 1_000_000:
            raise ValueError("rollout.prompts_per_step * rollout.samples_per_prompt must be <= 1,000,000")
        return self

    def fresh_groups_per_step(self) -> int:
        """The fewest unused (never trained on) groups a batch holds: a full batch, except in reflow, which
        tops a batch up with replayed groups to at most ``buffer.replay_ratio`` of it."""
        groups = self.rollout.prompts_per_step
        if self.mode.kind != "reflow":
            return groups
        return max(1, math.ceil((1 - self.buffer.replay_ratio) * groups))

    def planned_steps(self) -> int:
        """``run.total_steps``, or fewer when ``run.max_new_groups`` ends the run sooner in a mode whose every
        batch is a full batch of new groups (reflow's end is found as it runs)."""
        total, budget = self.run.total_steps, self.run.max_new_groups
        if budget == 0 or self.mode.kind == "reflow":
            return total
        return min(total, math.ceil(budget / self.rollout.prompts_per_step))

    def eval_due(self, step: int, last: int) -> bool:
        """Whether ``step`` is evaluated on held-out prompts (``last``: the run's last step, which always is)."""
        return bool(self.env.eval_prompts) and ((step + 1) % self.eval.every_steps == 0 or step == last)

    def checkpoint_due(self, step: int, last: int) -> bool:
        """Whether the trainer state after ``step`` is saved (``last``: the run's last step, which always is)."""
        return (step + 1) % self.run.checkpoint_every_steps == 0 or step == last
