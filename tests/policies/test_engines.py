"""Engines: behaviour log-probs agree with the trainer's, weights update in place."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reflow.config.schema import TrainConfig
from reflow.policies.engines import EngineSettings, generate_all, merge_batches
from reflow.policies.hf_engine import TransformersEngine
from reflow.policies.tokenizer import EOS_ID
from reflow.policies.trainer import Trainer
from reflow.storage.schema import GenBatch, GenRequest


def _settings(model_dir: Path) -> EngineSettings:
    return EngineSettings(model_dir=str(model_dir), dtype="float32", temperature=1.0, eos_token_id=EOS_ID,
                          max_model_len=512, max_concurrent_sequences=64, seed=0)


def _trainer_logprobs(model_dir: Path, prompt: list[int], response: list[int],
                      state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    trainer = Trainer(str(model_dir), TrainConfig(), seed=0)
    if state is not None:
        trainer.model.load_state_dict(state)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def test_transformers_engine_logprobs_match_trainer(random_model_dir: Path) -> None:
    engine = TransformersEngine(_settings(random_model_dir))
    reqs = [GenRequest(f"r{i}", [10 + i, 11, 12], max_tokens=12) for i in range(6)]
    results = generate_all(engine, reqs)
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)
    for req, res in zip(reqs, sorted(results, key=lambda r: r.request_id)):
        assert len(res.logprobs) == len(res.response_tokens) <= 12
        assert res.finish_reason == ("stop" if res.response_tokens[-1] == EOS_ID else "length")
        expected = _trainer_logprobs(random_model_dir, req.prompt_tokens, res.response_tokens)
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_transformers_engine_samples_follow_the_seed(random_model_dir: Path) -> None:
    """run.seed decides the samples, whatever state torch's global generator was in before."""
    from dataclasses import replace

    def sample(seed: int, before: int) -> list[list[int]]:
        torch.manual_seed(before)
        engine = TransformersEngine(replace(_settings(random_model_dir), seed=seed))
        reqs = [GenRequest(f"r{i}", [10 + i, 11], max_tokens=16) for i in range(8)]
        return [r.response_tokens for r in sorted(generate_all(engine, reqs), key=lambda r: r.request_id)]

    assert sample(3, before=1) == sample(3, before=2)
    assert sample(3, before=1) != sample(4, before=1)


def test_transformers_engine_update_weights_in_place(random_model_dir: Path) -> None:
    engine = TransformersEngine(_settings(random_model_dir))
    zeros = {k: torch.zeros_like(v) for k, v in engine.model.state_dict().items()}
    engine.update_weights(zeros, version=7)
    (res,) = generate_all(engine, [GenRequest("a", [5, 6], max_tokens=4)])
    assert res.version == 7
    assert torch.allclose(torch.tensor(res.logprobs), torch.full((len(res.logprobs),), -torch.log(torch.tensor(128.0))))


def test_transformers_engine_resumes_a_partial_rollout(random_model_dir: Path) -> None:
    """The resumed prefix is kept as is and conditions the new tokens, which carry the new version."""
    engine = TransformersEngine(_settings(random_model_dir), version=1)
    engine.update_weights(dict(engine.model.state_dict()), version=4)
    prefix, prefix_logprobs = [20, 21, 22], [-1.0, -2.0, -3.0]  # as an earlier round left them (not EOS)
    resumed = GenRequest("a", [5, 6], max_tokens=8, resume_tokens=prefix, resume_logprobs=prefix_logprobs,
                         resume_versions=[1, 1, 1], submitted_version=1)
    (res,) = generate_all(engine, [resumed])
    keep = len(prefix)
    assert res.response_tokens[:keep] == prefix and keep < len(res.response_tokens) <= 8
    assert res.logprobs[:keep] == prefix_logprobs
    assert res.token_versions == [1] * keep + [4] * (len(res.response_tokens) - keep)
    assert res.version == 1 and res.submitted_version == 1
    expected = _trainer_logprobs(random_model_dir, [5, 6], res.response_tokens)[keep:]
    assert torch.allclose(torch.tensor(res.logprobs[keep:]), expected, atol=1e-4)
    with pytest.raises(ValueError, match="no budget"):
        GenRequest("b", [1], max_tokens=2, resume_tokens=[3, 4], resume_logprobs=[0.0, 0.0], resume_versions=[0, 0])


VLLM_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from reflow.policies.engines import EngineSettings, generate_all
    from reflow.policies.vllm_engine import VLLMEngine
    from reflow.storage.schema import GenRequest
    def main():
        model_dir = sys.argv[1]
        s = EngineSettings(model_dir=model_dir, dtype="float32", temperature=1.0, eos_token_id=2,
                           max_model_len=512, max_concurrent_sequences=64, seed=0)
        eng = VLLMEngine(s)
        reqs = [GenRequest(f"r{i}", [10 + i, 11, 12], max_tokens=12) for i in range(6)]
        first = generate_all(eng, reqs)
        from transformers import AutoModelForCausalLM
        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        state = {k: v * 0.5 for k, v in state.items()}
        torch.save(state, sys.argv[2] + ".pt")
        eng.update_weights(state, version=3)
        second = generate_all(eng, reqs)
        # weights change while requests are in flight: each token keeps the version that sampled it
        original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        eng.submit([GenRequest(f"m{i}", [10 + i, 11, 12], max_tokens=12) for i in range(6)])
        third = eng.collect(max_steps=4)
        eng.update_weights(original, version=5)
        while eng.num_unfinished():
            third += eng.collect(max_steps=4)
        resumed = eng.resumed_prefix_tokens
        # a partial rollout aborted, then resumed after an update: the resumed tokens keep their log-probs
        eng.submit([GenRequest(f"p{i}", [10 + i, 11, 12], max_tokens=12) for i in range(6)])
        early = eng.collect(max_steps=3)
        partial = eng.abort(eng.pending_ids())
        eng.update_weights(state, version=7)
        fourth = generate_all(eng, [GenRequest(p.request_id, [10 + int(p.request_id[1:]), 11, 12], 12).resumed(p)
                                    for p in partial if p.response_tokens])
        rows = lambda rs: [dict(r.__dict__, version=r.version) for r in rs]
        json.dump({"first": rows(first), "second": rows(second), "third": rows(third), "partial": rows(partial),
                   "fourth": rows(fourth), "resumed": resumed}, open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


def _run_script(source: str, model_dir: Path, tmp_path: Path, *args: str) -> dict:
    """Run a vLLM check in its own process (``source`` model_dir out.json *args); what it wrote to out.json."""
    import json
    import os

    script = tmp_path / "vllm_check.py"
    script.write_text(source)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(out), *args], capture_output=True,
                          text=True, timeout=600, env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_logprobs_match_trainer_before_and_after_update(random_model_dir: Path, tmp_path: Path) -> None:
    data = _run_script(VLLM_SCRIPT, random_model_dir, tmp_path)
    state = torch.load(str(tmp_path / "out.json") + ".pt")
    for phase, weights, version in (("first", None, 0), ("second", state, 3)):
        for res in data[phase]:
            assert res["version"] == version
            assert len(res["logprobs"]) == len(res["response_tokens"]) >= 1
            prompt = [10 + int(res["request_id"][1:]), 11, 12]
            expected = _trainer_logprobs(random_model_dir, prompt, res["response_tokens"], weights)
            assert torch.allclose(torch.tensor(res["logprobs"]), expected, atol=2e-3), (phase, res["request_id"])
            assert res["token_versions"] == [version] * len(res["response_tokens"])
    spanning = 0
    for res in data["third"]:
        prompt = [10 + int(res["request_id"][1:]), 11, 12]
        versions = res["token_versions"]
        assert len(versions) == len(res["response_tokens"]) == len(res["logprobs"])
        assert versions == sorted(versions) and set(versions) <= {3, 5}
        assert res["version"] == min(versions)
        under = {3: _trainer_logprobs(random_model_dir, prompt, res["response_tokens"], state),
                 5: _trainer_logprobs(random_model_dir, prompt, res["response_tokens"], None)}
        expected = torch.stack([under[v][i] for i, v in enumerate(versions)])
        assert torch.allclose(torch.tensor(res["logprobs"]), expected, atol=2e-3), res["request_id"]
        spanning += len(set(versions)) == 2
    assert spanning >= 1, "no request spanned the weight update"
    assert data["resumed"] >= 3 * spanning  # the spanning requests were prefilled again (prompt + partial)
    partial = {r["request_id"]: r for r in data["partial"]}
    assert partial and all(r["finish_reason"] == "abort" for r in partial.values())
    assert {r["request_id"] for r in data["fourth"]} == {k for k, r in partial.items() if r["response_tokens"]}
    for res in data["fourth"]:
        before = partial[res["request_id"]]
        keep = len(before["response_tokens"])
        assert res["response_tokens"][:keep] == before["response_tokens"]
        assert res["logprobs"][:keep] == before["logprobs"]  # exactly the log-probs they were sampled with
        assert res["token_versions"] == [5] * keep + [7] * (len(res["response_tokens"]) - keep)
        prompt = [10 + int(res["request_id"][1:]), 11, 12]
        expected = _trainer_logprobs(random_model_dir, prompt, res["response_tokens"], state)[keep:]
        assert torch.allclose(torch.tensor(res["logprobs"][keep:]), expected, atol=2e-3), res["request_id"]


LINEAR_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch._dynamo.utils
    from reflow.policies.engines import EngineSettings, generate_all
    from reflow.policies.vllm_engine import VLLMEngine
    from reflow.storage.schema import GenRequest
    import vllm._custom_ops as ops
    def main():
        s = EngineSettings(model_dir=sys.argv[1], dtype="float32", temperature=1.0, eos_token_id=2,
                           max_model_len=512, max_concurrent_sequences=64, seed=0, cpu_linear=sys.argv[3])
        eng = VLLMEngine(s)
        out = generate_all(eng, [GenRequest(f"r{i}", [10 + i, 11, 12], max_tokens=12) for i in range(8)])
        json.dump({"onednn": bool(getattr(ops, "_supports_onednn", False)),
                   "compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                   "results": [dict(r.__dict__) for r in sorted(out, key=lambda r: r.request_id)]},
                  open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


@pytest.mark.vllm
@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_vllm_cpu_linear_torch_samples_what_onednn_samples(random_model_dir: Path, tmp_path: Path) -> None:
    """rollout.cpu_linear: torch's matmul replaces vLLM's oneDNN one, with the same samples and log-probs."""
    runs = {}
    for kind in ("onednn", "torch"):
        (tmp_path / kind).mkdir()
        runs[kind] = _run_script(LINEAR_SCRIPT, random_model_dir, tmp_path / kind, kind)
    assert runs["torch"]["onednn"] is False
    assert runs["onednn"]["onednn"] is True  # the vllm-cpu build has oneDNN, so the switch changed something
    for a, b in zip(runs["onednn"]["results"], runs["torch"]["results"], strict=True):
        assert a["response_tokens"] == b["response_tokens"]
        assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4)


@pytest.mark.vllm
@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_an_eager_engine_worker_compiles_nothing_and_samples_the_same(random_model_dir: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout.enforce_eager``: the workers' environment turns torch.compile off, so vLLM's small compiled
    sampler helpers (its log-probs' rank count) run eagerly instead of compiling at every engine's start, with
    the same samples and log-probs."""
    from reflow.infra.placement import worker_env

    runs = {}
    for eager in (False, True):
        (tmp_path / str(eager)).mkdir()
        for name in ("TORCHDYNAMO_DISABLE", *worker_env(1, eager)):
            monkeypatch.delenv(name, raising=False)
        for name, value in worker_env(1, eager).items():
            monkeypatch.setenv(name, value)
        runs[eager] = _run_script(LINEAR_SCRIPT, random_model_dir, tmp_path / str(eager), "torch")
    assert runs[False]["compiled"] >= 1  # vLLM compiles a helper even with enforce_eager: the switch matters
    assert runs[True]["compiled"] == 0
    for a, b in zip(runs[False]["results"], runs[True]["results"], strict=True):
        assert a["response_tokens"] == b["response_tokens"] and a["response_tokens"]
        assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5)


KEEP_KV_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from reflow.policies.engines import EngineSettings
    from reflow.policies.vllm_engine import VLLMEngine
    from reflow.storage.schema import GenRequest
    def main():
        s = EngineSettings(model_dir=sys.argv[1], dtype="float32", temperature=1.0, eos_token_id=2,
                           max_model_len=512, max_concurrent_sequences=64, seed=0, keep_kv_on_update=True)
        eng = VLLMEngine(s)
        from transformers import AutoModelForCausalLM
        original = AutoModelForCausalLM.from_pretrained(sys.argv[1]).state_dict()
        zeros = {k: torch.zeros_like(v) for k, v in original.items()}
        eng.submit([GenRequest(f"k{i}", [10 + i, 11, 12], max_tokens=16) for i in range(6)])
        out = eng.collect(max_steps=4)
        eng.update_weights(zeros, version=9)
        while eng.num_unfinished():
            out += eng.collect(max_steps=4)
        # a parked round (sorted_partial): its rest stays in the engine across the update and goes on next round
        from reflow.policies.rounds import run_round
        class Goal:
            def __init__(self, need): self.need, self.n = need, 0
            def observe(self, result): self.n += 1
            def met(self): return self.n >= self.need
        eng.update_weights(original, version=10)
        queue = [GenRequest(f"q{i}", [10 + i, 11, 12], max_tokens=8 + 8 * i) for i in range(6)]
        first = run_round(eng, queue, Goal(1), 64, park=True)
        eng.update_weights(zeros, version=11)
        resumed = [GenRequest(r.request_id, [10 + int(r.request_id[1:]), 11, 12], 8 + 8 * int(r.request_id[1:]),
                              r.response_tokens, r.logprobs, r.token_versions, r.submitted_version)
                   for r in first.aborted]
        second = run_round(eng, resumed, Goal(len(resumed)), 64)
        rows = lambda rs: [dict(r.__dict__) for r in rs]
        json.dump({"results": rows(out), "resumed": eng.resumed_prefix_tokens, "parked": rows(first.aborted),
                   "continued": list(second.continued), "second": rows(second.finished)}, open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_keeps_the_kv_cache_across_an_update(random_model_dir: Path, tmp_path: Path) -> None:
    """kv_on_update='keep': no re-prefill, in the stream or across a parked round; tokens after the update are
    the new weights' (zeros: uniform)."""
    data = _run_script(KEEP_KV_SCRIPT, random_model_dir, tmp_path)
    uniform = -float(torch.log(torch.tensor(128.0)))
    spanning = 0
    for res in data["results"]:
        versions = res["token_versions"]
        assert versions == sorted(versions) and set(versions) <= {0, 9}
        old = versions.count(0)
        prompt = [10 + int(res["request_id"][1:]), 11, 12]
        expected = _trainer_logprobs(random_model_dir, prompt, res["response_tokens"])[:old]
        assert torch.allclose(torch.tensor(res["logprobs"][:old]), expected, atol=2e-3), res["request_id"]
        assert res["logprobs"][old:] == pytest.approx([uniform] * (len(versions) - old), abs=1e-4)
        spanning += 0 < old < len(versions)
    assert spanning >= 1, "no request spanned the weight update"
    parked = {r["request_id"]: r for r in data["parked"]}
    assert parked and set(data["continued"]) == set(parked) == {r["request_id"] for r in data["second"]}
    for res in data["second"]:
        before = parked[res["request_id"]]
        keep = len(before["response_tokens"])
        assert res["response_tokens"][:keep] == before["response_tokens"]
        assert res["logprobs"][:keep] == before["logprobs"]
        assert res["token_versions"] == [10] * keep + [11] * (len(res["response_tokens"]) - keep)
        assert res["logprobs"][keep:] == pytest.approx([uniform] * (len(res["logprobs"]) - keep), abs=1e-4)
    assert data["resumed"] == 0  # nothing was prefilled again, in the stream or across the parked round


class _SleepyLLM:
    """vLLM's ``LLM`` as ``VLLMEngine`` drives it around sleep mode: records the calls, generates nothing."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.llm_engine = self
        self.added: list[str] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        self.calls.append((method, dict(kwargs["weights_iterator"])["w"].item()))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def add_request(self, request_id: str, prompt, params) -> None:
        self.added.append(request_id)

    def abort_request(self, ids) -> None:
        self.calls.append(("abort", list(ids)))


@pytest.mark.vllm
def test_vllm_engine_sleeps_to_rest_and_wakes_with_the_newest_weights(random_model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A flex worker's engine (``sleep_mode``) on a platform with sleep mode: ``rest`` sleeps at level 1 only
    with nothing in flight; weights pushed while asleep are deferred, and the next requests wake it in verl's
    order: weights, the newest push loaded over them, then the KV cache. The real sleep mode needs a GPU
    (``test_vllm_engine_rests_on_a_gpu``)."""
    import dataclasses

    import vllm
    from vllm.platforms import current_platform

    from reflow.policies.vllm_engine import VLLMEngine

    monkeypatch.setattr(vllm, "LLM", _SleepyLLM)
    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.setenv(name, "1")  # the engine sets them; restored after the test
    settings = dataclasses.replace(_settings(random_model_dir), cpu_linear="onednn")  # vLLM's own ops unpatched
    eng = VLLMEngine(dataclasses.replace(settings, sleep_mode=True))
    llm = eng._llm
    assert llm.kwargs["enable_sleep_mode"] is True
    eng.submit([GenRequest("a", [5, 6], max_tokens=4)])
    assert eng.rest() is False and llm.calls == []  # a request in flight: no sleep
    eng.abort(["a"])
    llm.calls.clear()
    assert eng.rest() is True and eng.rest() is False  # asleep already
    assert llm.calls == [("sleep", 1)]
    eng.update_weights({"w": torch.tensor(1.0)}, version=3)
    eng.update_weights({"w": torch.tensor(2.0)}, version=4)
    assert llm.calls == [("sleep", 1)] and eng.version == 4  # nothing loaded into a sleeping engine
    eng.submit([GenRequest("b", [5, 6], max_tokens=4)])
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("reload_weights", 2.0), ("wake_up", ["kv_cache"])]
    assert llm.added[-1] == "b" and eng.sleeps == 1
    eng.abort(["b"])
    llm.calls.clear()
    eng.update_weights({"w": torch.tensor(3.0)}, version=5)  # awake again: loaded at once
    assert llm.calls[0] == ("reload_weights", 3.0)
    # an engine that was not asked for sleep mode never sleeps
    plain = VLLMEngine(settings)
    assert "enable_sleep_mode" not in plain._llm.kwargs and plain.rest() is False and plain._llm.calls == []


SLEEP_SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from reflow.policies.engines import EngineSettings, generate_all
    from reflow.policies.vllm_engine import VLLMEngine
    from reflow.storage.schema import GenRequest
    def main():
        model_dir = sys.argv[1]
        s = EngineSettings(model_dir=model_dir, dtype="float32", temperature=1.0, eos_token_id=2,
                           max_model_len=512, max_concurrent_sequences=16, seed=0, sleep_mode=True,
                           gpu_memory_utilization=0.3)
        eng = VLLMEngine(s)
        first = generate_all(eng, [GenRequest(f"a{i}", [10 + i, 11, 12], max_tokens=8) for i in range(4)])
        free = lambda: torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
        before = free()
        rested = eng.rest()
        after = free()
        zeros = {k: torch.zeros_like(v)
                 for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
        eng.update_weights(zeros, version=4)
        second = generate_all(eng, [GenRequest(f"b{i}", [10 + i, 11, 12], max_tokens=8) for i in range(4)])
        rows = lambda rs: [dict(r.__dict__, version=r.version) for r in rs]
        json.dump({"first": rows(first), "second": rows(second), "rested": rested, "freed": after - before},
                  open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


def _check_rest(data: dict) -> None:
    """Generation after a rest and a push of zero weights: every token the new version's, uniform (zeros)."""
    uniform = -float(torch.log(torch.tensor(128.0)))
    assert len(data["first"]) == len(data["second"]) == 4
    for res in data["second"]:
        assert res["token_versions"] == [4] * len(res["response_tokens"]) and res["response_tokens"]
        assert res["logprobs"] == pytest.approx([uniform] * len(res["logprobs"]), abs=1e-4)


@pytest.mark.vllm
@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_vllm_engine_does_not_rest_on_the_cpu(random_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's CPU build has no sleep mode: ``rest`` says so, and the engine generates with what it is pushed."""
    data = _run_script(SLEEP_SCRIPT, random_model_dir, tmp_path)
    assert data["rested"] is False
    _check_rest(data)


@pytest.mark.vllm
@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_engine_rests_on_a_gpu(random_model_dir: Path, tmp_path: Path) -> None:
    """On a GPU: ``rest`` sleeps (GPU memory freed), and the engine wakes with the weights pushed meanwhile."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    data = _run_script(SLEEP_SCRIPT, random_model_dir, tmp_path)
    assert data["rested"] is True and data["freed"] > 0
    _check_rest(data)


def test_merge_batches_keeps_every_result_and_counts_idle_slots_of_the_early_engine() -> None:
    a = GenBatch(results=["a1", "a2"], seconds=2.0, busy_slot_seconds=3.0, slots=2)
    b = GenBatch(results=["b1"], seconds=1.0, busy_slot_seconds=1.0, slots=2)
    merged = merge_batches([a, b])
    assert merged.results == ["a1", "a2", "b1"]
    assert merged.seconds == 2.0  # the round lasts as long as its slowest engine
    assert merged.busy_slot_seconds == 4.0 and merged.slots == 4
    # bubble: 1 - 4 / (4 x 2) = 0.5; b's two slots sat empty for its last second
    assert 1 - merged.busy_slot_seconds / (merged.slots * merged.seconds) == pytest.approx(0.5)
