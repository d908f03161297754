"""Multi-turn tool use on the real engines: stop at ``</code>``, run the block in the sandbox, continue.

The bigram model (conftest) closes any code block its prompt leaves open and, after a tool output,
writes ``#``; so the whole turn structure is deterministic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reflow.envs.tools import format_output, run_tool_call
from reflow.policies.engines import EngineSettings, generate_all
from reflow.policies.hf_engine import TransformersEngine
from reflow.policies.multiturn import MultiTurnEngine, ToolSettings
from reflow.policies.tokenizer import EOS_ID, build_tokenizer
from reflow.storage.schema import GenRequest

TOK = build_tokenizer()
PROMPT = "6*7=<code>print(6*7)"
OUTPUT = "\n<output>42</output>\n"


def _settings(model_dir: Path) -> EngineSettings:
    return EngineSettings(model_dir=str(model_dir), dtype="float32", temperature=1.0, eos_token_id=EOS_ID,
                          max_model_len=256, max_concurrent_sequences=8, seed=0)


class SandboxRunner:
    """Runs each call in the real sandbox at once (the run uses Ray tasks; this test needs no Ray)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []

    def start(self, key: str, transcript: str) -> None:
        self.done.append((key, run_tool_call(transcript, 2.0, 64)))

    def ready(self, timeout_s: float) -> list[tuple[str, str]]:
        out, self.done = self.done, []
        return out

    def pending(self) -> int:
        return len(self.done)


def _encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def _check(res_tokens: list[int], mask: list[int], logprobs: list[float], versions: list[int]) -> None:
    text = TOK.decode(res_tokens, skip_special_tokens=False)
    assert text == "</code>" + OUTPUT + "#<eos>"
    n_code, n_out = len("</code>"), len(OUTPUT)
    assert mask == [1] * n_code + [0] * n_out + [1, 1]
    assert logprobs[n_code: n_code + n_out] == [0.0] * n_out
    assert all(lp > -1e-3 for lp in logprobs)  # the policy tokens were (near) certain
    assert len(versions) == len(res_tokens)


def test_transformers_engine_stops_on_a_stop_string(bigram_model_dir: Path) -> None:
    engine = TransformersEngine(_settings(bigram_model_dir))
    stopped, plain = generate_all(engine, [GenRequest("s", _encode("print(1)"), 32, stop=("</code>",)),
                                           GenRequest("t", _encode("print(2)"), 32)])
    if stopped.request_id != "s":
        stopped, plain = plain, stopped
    assert TOK.decode(stopped.response_tokens, skip_special_tokens=False) == "</code>"
    assert stopped.finish_reason == "stop" and len(stopped.logprobs) == len(stopped.response_tokens)
    assert TOK.decode(plain.response_tokens, skip_special_tokens=False) == "</code><eos>"


def test_transformers_multi_turn_rollout(bigram_model_dir: Path) -> None:
    assert format_output("42", 64) == OUTPUT
    engine = MultiTurnEngine(TransformersEngine(_settings(bigram_model_dir), version=2),
                             ToolSettings(max_calls=2, max_output_chars=64, timeout_s=2.0), SandboxRunner(),
                             _encode, lambda ids: TOK.decode(ids, skip_special_tokens=False))
    (res,) = generate_all(engine, [GenRequest("a", _encode(PROMPT), max_tokens=64)])
    assert res.finish_reason == "stop" and engine.tool_calls == 1
    _check(res.response_tokens, res.loss_mask, res.logprobs, res.token_versions)
    assert set(res.token_versions) == {2}


VLLM_SCRIPT = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from transformers import AutoModelForCausalLM
    from test_multiturn_engines import PROMPT, TOK, SandboxRunner, _encode, _settings
    from reflow.policies.multiturn import MultiTurnEngine, ToolSettings
    from reflow.storage.schema import GenRequest
    from reflow.policies.engines import generate_all
    from reflow.policies.vllm_engine import VLLMEngine
    def main():
        vllm = VLLMEngine(_settings(Path(sys.argv[1])))
        stop = generate_all(vllm, [GenRequest("s", _encode("print(1)"), 32, stop=("</code>",))])
        engine = MultiTurnEngine(vllm, ToolSettings(max_calls=2, max_output_chars=64, timeout_s=2.0),
                                 SandboxRunner(), _encode, lambda ids: TOK.decode(ids, skip_special_tokens=False))
        engine.submit([GenRequest("a", _encode(PROMPT), max_tokens=64)])
        done = []
        while not engine.tool_calls:  # step until the call starts, then load new weights (version 4)
            done += engine.collect(max_steps=1)
        engine.update_weights(AutoModelForCausalLM.from_pretrained(sys.argv[1]).state_dict(), version=4)
        done += generate_all(engine, [])
        rows = lambda rs: [dict(r.__dict__) for r in rs]
        json.dump({"stop": rows(stop), "done": rows(done), "calls": engine.tool_calls}, open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_multi_turn_rollout(bigram_model_dir: Path, tmp_path: Path) -> None:
    script, out = tmp_path / "vllm_tools.py", tmp_path / "out.json"
    script.write_text(VLLM_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(bigram_model_dir), str(out), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=600,
                          env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    (stop,) = data["stop"]
    assert TOK.decode(stop["response_tokens"], skip_special_tokens=False) == "</code>"
    assert stop["finish_reason"] == "stop"
    (res,) = data["done"]
    assert data["calls"] == 1 and res["finish_reason"] == "stop"
    _check(res["response_tokens"], res["loss_mask"], res["logprobs"], res["token_versions"])
    n_code = len("</code>")
    assert res["token_versions"] == [0] * (n_code + len(OUTPUT)) + [4, 4]  # tool tokens: the closing token's
