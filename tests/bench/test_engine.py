"""The engine throughput sweep: a fixed number of running sequences, tokens counted exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reflow.bench.engine import measure
from reflow.storage.schema import GenRequest, GenResult


class _OneTokenPerStep:
    """Each running request gains one token per step and finishes after ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.running: dict[str, list[int]] = {}
        self.steps_with: list[int] = []

    def submit(self, requests: list[GenRequest]) -> None:
        for r in requests:
            assert r.request_id not in self.running
            self.running[r.request_id] = []

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        self.steps_with.append(len(self.running))
        done = []
        for rid, toks in list(self.running.items()):
            toks.append(7)
            if len(toks) == self.length:
                del self.running[rid]
                done.append(GenResult(rid, toks, [-1.0] * len(toks), "stop", [0] * len(toks), 0))
        return done

    def abort(self, ids: list[str]) -> list[GenResult]:
        return [GenResult(i, (t := self.running.pop(i)), [-1.0] * len(t), "abort", [0] * len(t), 0) for i in ids]

    def tokens_in_flight(self) -> int:
        return sum(len(t) for t in self.running.values())


def test_measure_keeps_the_engine_at_the_concurrency_and_counts_tokens_exactly() -> None:
    engine = _OneTokenPerStep(length=3)
    point = measure(engine, [[1, 2], [3]], concurrency=5, max_tokens=8, steps=7, warmup=2, tag="t")
    assert engine.steps_with == [5] * 9  # finished requests replaced before every step
    assert point.running_mean == 5 and point.steps == 7
    assert point.tokens == 5 * 7  # one token per running request per timed step, warm-up excluded
    assert point.tokens_per_s == pytest.approx(point.tokens / point.seconds)
    assert engine.running == {}  # what still ran at the end was aborted


def test_measure_rejects_empty_settings() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        measure(_OneTokenPerStep(2), [[1]], concurrency=0, max_tokens=4, steps=1, warmup=0, tag="t")


@pytest.mark.parametrize(("flag", "value"), [("--concurrency", "8,x"), ("--engines", "0,2"), ("--engines", "1,y")])
def test_bench_engine_refuses_bad_levels(flag: str, value: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "reflow.cli.main", "bench-engine", flag, value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and flag in proc.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_engine_on_vllm(random_model_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reflow.cli.main", "bench-engine",
         "--set", f"model.path={json.dumps(str(random_model_dir))}", "--set", "model.dtype=\"float32\"",
         "--set", "rollout.engine=\"vllm\"", "--set", "rollout.max_response_tokens=32",
         "--concurrency", "2,8", "--steps", "6", "--warmup", "2", "--prefill-tokens", "16", "--output", str(tmp_path),
         "--engines", "1,2", "--pool-requests", "8"],
        capture_output=True, text=True, timeout=600, env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads((tmp_path / "bench_engine.json").read_text())
    points = figures["points"]
    assert [p["concurrency"] for p in points] == [2, 8]
    for p in points:
        assert p["running_mean"] == p["concurrency"]
        assert p["tokens"] == p["concurrency"] * p["steps"]  # one token per running sequence per decode step
        assert p["tokens_per_s"] > 0
    assert "tokens/s relative to 2 running" in proc.stdout
    [prefill] = figures["prefill"]
    assert prefill["requests"] == 8 and prefill["prompt_tokens"] == 16 and prefill["prefill_tokens_per_s"] > 0
    # data-parallel engines: the same 8 requests on one engine actor, then dealt to two
    one, two = figures["pool"]
    assert (one["engines"], two["engines"]) == (1, 2) and one["requests"] == two["requests"] == 8
    assert len(one["engine_seconds"]) == 1 and len(two["engine_seconds"]) == 2
    assert one["tokens"] > 0 and two["tokens"] > 0 and two["vs_first"] == pytest.approx(
        two["tokens_per_s"] / one["tokens_per_s"])
    assert "tokens/s relative to 1 engine(s): 1: 1.00x, 2: " in proc.stdout
