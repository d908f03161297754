"""End to end with tool use: the tool_calc workload through the real flow, engines, sandbox, Delta.

A few steps, sync (vLLM) and async (transformers, streaming feeder): rollouts stop at ``</code>``,
the block runs in the sandbox as a Ray task, its output comes back masked, and the trainer trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deltalake import DeltaTable

from reflow.envs.tools import OUTPUT_OPEN
from reflow.policies.tokenizer import build_tokenizer

from .test_rl_train_e2e import REPO, _run

SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
         "model.tiny.intermediate_size=128", "model.tiny.num_layers=2", "model.tiny.sft_steps=150",
         "run.total_steps=3", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "env.eval_prompts=4", "eval.every_steps=2", "concurrency.initial_sequences=16",
         "concurrency.min_sequences=4", "buffer.max_staleness_versions=1"]
OPEN = "\n" + OUTPUT_OPEN  # what an appended tool output starts with


def _check_tool_rows(run_dir: Path) -> list[dict]:
    rows = DeltaTable(str(run_dir / "tables/trajectories")).to_pyarrow_dataset().to_table().to_pylist()
    tok = build_tokenizer()
    calls = 0
    for r in rows:
        n = r["response_length"]
        assert len(r["loss_mask"]) == len(r["behaviour_logprobs"]) == len(r["token_versions"]) == n
        assert r["policy_version"] == min(r["token_versions"], default=r["policy_version"])
        text = tok.decode(r["response_tokens"], skip_special_tokens=False)
        masked = "".join(ch for ch, m in zip([tok.decode([t]) for t in r["response_tokens"]], r["loss_mask"])
                         if m == 0)
        spans = _spans(text)
        outputs = [text[a:b] for a, b in spans]
        if r["finish_reason"] == "length" and (not spans or spans[-1][1] < len(text)):
            # an output cut by the token budget inside its opening tag
            outputs += [text[-k:] for k in range(len(OPEN) - 1, 0, -1)  # one token per character
                        if OPEN.startswith(text[-k:]) and not any(r["loss_mask"][-k:])][:1]
        assert masked == "".join(outputs), r["trajectory_id"]  # exactly the appended tool outputs are masked
        assert all(lp == 0.0 for lp, m in zip(r["behaviour_logprobs"], r["loss_mask"]) if m == 0)
        assert len(outputs) <= 2  # tools.max_calls
        calls += len(outputs)
    assert calls > 0, "no rollout made a tool call"
    return rows


def _spans(text: str) -> list[tuple[int, int]]:
    from reflow.envs.tools import output_spans

    return output_spans(text)


@pytest.mark.slow
@pytest.mark.vllm
def test_tools_sync_vllm_and_async_transformers_end_to_end(tmp_path: Path) -> None:
    for mode, engine in (("sync", "vllm"), ("async", "transformers")):
        out = tmp_path / mode
        sets = [*SMALL, f'mode.kind="{mode}"', f'rollout.engine="{engine}"',
                f'model.cache_dir="{tmp_path / "models"}"']
        proc = _run(["run", "--config", str(REPO / "configs/tools.toml"), "--runs", str(out),
                     *[arg for s in sets for arg in ("--set", s)]], cwd=tmp_path, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (run_dir,) = [p for p in out.iterdir() if (p / "run.json").is_file()]
        rows = _check_tool_rows(run_dir)
        usage = DeltaTable(str(run_dir / "tables/usage")).to_pyarrow_dataset().to_table().to_pylist()
        assert {u["trainer_step"] for u in usage} == {0, 1, 2}
        steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [0, 1, 2]
        if mode == "sync":  # step k trains on exactly round k's rows: the trainer counts only policy tokens
            assert len(rows) == 3 * 16 and {u["staleness"] for u in usage} == {0}
            for s in steps:  # (those of zero-advantage samples are skipped, and counted as such)
                policy_tokens = sum(sum(r["loss_mask"]) for r in rows if r["rollout_step"] == s["step"])
                assert s["metrics"]["trained_tokens"] + s["metrics"]["skipped_tokens"] == policy_tokens
            assert sum(s["metrics"]["tool_calls"] for s in steps) > 0
