"""The built-in tiny policy: a small Qwen3-architecture model, warm-started and cached.

``ensure_tiny_model`` returns a standard Hugging Face directory (config.json,
model.safetensors, generation_config.json, tokenizer files) under
``<model.cache_dir>/<key>/``, where the key hashes the tiny-model config, the
env config, the seed, ``CODE_VERSION`` and (except for arith) a sample of the
warm-start data. A complete directory is reused at
once; otherwise the model is built in a temporary directory and renamed into
place, so a killed build never leaves a half-written model.

Warm start: supervised fine-tuning on the env's reference solutions (loss on
response tokens and the final ``<eos>``, not on the prompt), AdamW with a
linear warm-up and a cosine decay. The SFT prompts come from the train split
of an env seeded differently from the run, so the RL run does not start on
prompts the warm start memorised, and never from eval (the env holds eval
prompts out). The warm start is deliberately short: the policy is right often
at temperature 1 but far from always, which leaves RL room to improve.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from reflow.config.schema import EnvConfig, ModelConfig, TinyModelConfig
from reflow.envs.base import Env, make_env
from reflow.envs.tools import output_spans
from reflow.policies.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer, save_tokenizer

CODE_VERSION = "tiny-v3"  # bump when the build or warm start changes, to invalidate caches
SFT_SEED_OFFSET = 1_000_003  # SFT prompts: train split of an env seeded seed + this
WARMUP_FRACTION = 0.05
MIN_LR_FRACTION = 0.1
PROGRESS_EVERY_STEPS = 25
BUCKET_STEPS = 16  # SFT batches drawn together and length-sorted
_COMPLETE_MARKER = "model.safetensors"
FINGERPRINT_PROMPTS = 16  # warm-start examples hashed into the cache key
IGNORE_INDEX = -100


# The env fields an arith warm start depends on (the EnvConfig of tiny-v3): the key hashes only
# these for arith, so fields added for other workloads leave existing arith models cached.
ARITH_KEY_FIELDS = ("kind", "min_terms", "max_terms", "long_share", "tail_p", "max_operand", "format_reward",
                    "eval_prompts")


def tiny_model_key(tiny: TinyModelConfig, env_cfg: EnvConfig, seed: int) -> str:
    """Cache key of a built model: a hash of everything that determines its weights.

    Besides the configs, the key of every workload but arith hashes a sample of
    its warm-start data (``warm_start_fingerprint``), so a change to a synthetic
    generator or to the prompt layout invalidates the cached model by itself.
    Arith keys stay as they were in tiny-v3 (its generator is pinned by its tests).
    """
    env = env_cfg.model_dump(mode="json")
    fields: dict[str, object] = {"tiny": tiny.model_dump(mode="json"), "seed": seed, "code": CODE_VERSION}
    if env_cfg.kind == "arith":
        env = {name: env[name] for name in ARITH_KEY_FIELDS}
    else:
        fields["data"] = warm_start_fingerprint(env_cfg, seed)
    payload = json.dumps({**fields, "env": env}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def warm_start_fingerprint(env_cfg: EnvConfig, seed: int) -> str:
    """A hash of the first ``FINGERPRINT_PROMPTS`` warm-start prompts and their reference solutions."""
    env = make_env(env_cfg, seed + SFT_SEED_OFFSET)
    digest = hashlib.sha256()
    for prompt in env.prompts("train", 0, FINGERPRINT_PROMPTS):
        digest.update(json.dumps([prompt.text, env.reference_solution(prompt)]).encode())
    return digest.hexdigest()[:16]


def ensure_tiny_model(model_cfg: ModelConfig, env_cfg: EnvConfig, seed: int,
                      progress: Callable[[str], None] = print, threads: int = 2) -> Path:
    """Directory of the warm-started tiny model for these configs, building it if needed.

    ``threads``: torch threads of the warm start (``resources.torch_threads``; not part of the key).
    """
    target = Path(model_cfg.cache_dir) / tiny_model_key(model_cfg.tiny, env_cfg, seed)
    if (target / _COMPLETE_MARKER).is_file():
        progress(f"tiny model: cached at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        build_tiny_model(model_cfg.tiny, env_cfg, seed, staging, progress, threads)
        try:
            os.rename(staging, target)  # atomic: the directory appears complete or not at all
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise
            progress("tiny model: another process finished the same build first; using it")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(tiny: TinyModelConfig, env_cfg: EnvConfig, seed: int, out_dir: Path,
                     progress: Callable[[str], None] = print, threads: int = 2) -> None:
    """Initialise, warm-start and save a tiny model into ``out_dir`` (no caching)."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(tiny))
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"tiny model: {n_params / 1e6:.2f}M parameters, warm start for {tiny.sft_steps} steps")
    env = make_env(env_cfg, seed + SFT_SEED_OFFSET)
    warm_start(model, env, tiny, seed, progress, threads)
    save_model_dir(model, out_dir)


def qwen3_config(tiny: TinyModelConfig) -> Qwen3Config:
    """The Qwen3 architecture at the tiny config's size, with this tokenizer's special ids."""
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )


def warm_start(model: Qwen3ForCausalLM, env: Env, tiny: TinyModelConfig, seed: int,
               progress: Callable[[str], None] = print, threads: int = 2) -> None:
    """SFT on reference solutions: AdamW, linear warm-up then cosine decay to 10% of the peak.

    ``threads`` torch threads: on a machine busy with other work, 1 is many times faster than
    more threads than idle cores (measured: 1.4 s against 13 s per step on a loaded 2-core machine).
    """
    if tiny.sft_steps == 0:
        return
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tiny.sft_learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, tiny.sft_steps))
    model.train()
    started = time.monotonic()
    running_loss = 0.0
    try:
        for step, (input_ids, labels) in enumerate(sft_batches(env, tiny, seed), start=1):
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            running_loss += loss.item()
            if step % PROGRESS_EVERY_STEPS == 0 or step == tiny.sft_steps:
                seen = PROGRESS_EVERY_STEPS if step % PROGRESS_EVERY_STEPS == 0 else step % PROGRESS_EVERY_STEPS
                progress(f"tiny model: sft step {step}/{tiny.sft_steps} loss {running_loss / seen:.4f} "
                         f"elapsed {time.monotonic() - started:.1f}s")
                running_loss = 0.0
    finally:
        torch.set_num_threads(previous_threads)
    model.eval()


def lr_factor(step: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based): warm-up, then cosine to 10%."""
    warmup = max(1, int(WARMUP_FRACTION * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def sft_batches(env: Env, tiny: TinyModelConfig, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``tiny.sft_steps`` batches of ``(input_ids, labels)``, each ``(examples, longest)`` long.

    A row is prompt + reference + ``<eos>``, right-padded with ``<pad>``; labels
    copy the ids on response tokens (incl. ``<eos>``) and are ``IGNORE_INDEX``
    on prompt, padding and tool output (``<output>`` spans of tool-using
    references: as in RL, the policy is never trained to write them; the
    tokenizer is character-level, so character spans are token spans). No attention mask is needed: padding only follows
    the real tokens, and causal attention never lets a real token see it.
    Examples are drawn ``BUCKET_STEPS`` batches at a time, sorted by length and
    cut into batches (shuffled): the long tail would otherwise make most of
    every batch padding.
    """
    tokenizer = build_tokenizer()
    per_step = tiny.sft_examples_per_step
    order = random.Random(seed)
    for first in range(0, tiny.sft_steps, BUCKET_STEPS):
        n_batches = min(BUCKET_STEPS, tiny.sft_steps - first)
        prompts = env.prompts("train", first * per_step, n_batches * per_step)
        prompt_ids = tokenizer([p.text for p in prompts], add_special_tokens=False)["input_ids"]
        corrupt = getattr(env, "corrupt_reference", None)
        references = [noisy_reference(env.reference_solution(p), tiny.sft_answer_noise, order, corrupt)
                      for p in prompts]
        response_ids = tokenizer(references, add_special_tokens=False)["input_ids"]
        rows = sorted(((p_ids, r_ids + [EOS_ID], output_spans(ref))
                       for p_ids, r_ids, ref in zip(prompt_ids, response_ids, references)),
                      key=lambda row: len(row[0]) + len(row[1]))
        batches = [rows[i * per_step:(i + 1) * per_step] for i in range(n_batches)]
        order.shuffle(batches)
        for batch in batches:
            yield _pad_rows(batch, tiny.max_position_embeddings)


def noisy_reference(reference: str, noise: float, rng: random.Random,
                    corrupt: Callable[[str, random.Random], str] | None = None) -> str:
    """With probability ``noise``, a reference with a wrong final answer; else ``reference``.

    ``corrupt`` is the env's optional hook ``corrupt_reference(reference, rng)``
    (e.g. math moves the number in ``\\boxed{}``, code a constant of the
    program). Without it, the final ``#<answer>`` (arith's answer line) moves
    by 1..3 either way (staying >= 0).
    """
    if rng.random() >= noise:
        return reference
    if corrupt is not None:
        return corrupt(reference, rng)
    body, _, answer = reference.rpartition("#")
    try:
        value = int(answer)
    except ValueError:  # not an answer-line workload: leave it clean
        return reference
    delta = rng.choice((-3, -2, -1, 1, 2, 3))
    return f"{body}#{value + delta if value + delta >= 0 else value - delta}"


def _pad_rows(rows: list[tuple[list[int], list[int], list[tuple[int, int]]]],
              max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    longest = min(max_len, max(len(p) + len(r) for p, r, _ in rows))
    input_ids = torch.full((len(rows), longest), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt_ids, response_ids, masked) in enumerate(rows):
        ids = (prompt_ids + response_ids)[:longest]
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(prompt_ids): len(ids)] = torch.tensor(ids[len(prompt_ids):])
        for start, end in masked:  # spans index the response
            labels[i, len(prompt_ids) + start: len(prompt_ids) + end] = IGNORE_INDEX
    return input_ids, labels


def save_model_dir(model: Qwen3ForCausalLM, out_dir: Path) -> None:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files.

    The generation config names the special ids only; sampling settings come
    from the run config, never from defaults hidden in the model directory.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(out_dir)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(str(out_dir), safe_serialization=True)
