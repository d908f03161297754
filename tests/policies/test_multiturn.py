"""The multi-turn tool driver over an in-process scripted engine and tool runner."""

from __future__ import annotations

import pytest

from reflow.envs.tools import extract_code, format_output
from reflow.policies.engines import generate_all
from reflow.policies.multiturn import MultiTurnEngine, ToolSettings
from reflow.policies.tokenizer import EOS_TOKEN, build_tokenizer
from reflow.storage.schema import GenRequest, GenResult

TOK = build_tokenizer()


def encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


class ScriptedEngine:
    """Each ``collect`` answers every running request with its next scripted turn (log-prob -0.5 per token)."""

    def __init__(self, turns: dict[str, list[str]]) -> None:
        self.turns = {k: list(v) for k, v in turns.items()}
        self.version = 0
        self.running: list[GenRequest] = []
        self.submitted: list[GenRequest] = []
        self.paused = False  # collect steps nothing (requests stay running)

    def submit(self, requests: list[GenRequest]) -> None:
        self.running += requests
        self.submitted += requests

    def num_unfinished(self) -> int:
        return len(self.running)

    def pending_ids(self) -> list[str]:
        return [r.request_id for r in self.running]

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        if self.paused:
            return []
        out = []
        for req in self.running:
            new = encode(self.turns[req.request_id].pop(0))[: req.max_tokens - len(req.resume_tokens)]
            tokens = req.resume_tokens + new
            text = decode(new)
            reason = "stop" if text.endswith(EOS_TOKEN) or any(text.endswith(s) for s in req.stop) else "length"
            out.append(GenResult(req.request_id, tokens, req.resume_logprobs + [-0.5] * len(new), reason,
                                 req.resume_versions + [self.version] * len(new),
                                 self.version if req.submitted_version is None else req.submitted_version))
        self.running = []
        return out

    def abort(self, request_ids: list[str]) -> list[GenResult]:
        hit = [r for r in self.running if r.request_id in request_ids]
        self.running = [r for r in self.running if r.request_id not in request_ids]
        return [GenResult(r.request_id, r.resume_tokens, r.resume_logprobs, "abort", r.resume_versions, 0)
                for r in hit]

    def update_weights(self, state: dict, version: int) -> None:
        self.version = version


class Calculator:
    """Runs ``print(<expr>)`` blocks with ``eval``; holds results back while ``hold`` is set."""

    def __init__(self, max_chars: int = 64) -> None:
        self.max_chars, self.hold = max_chars, False
        self.started: list[str] = []
        self._done: list[tuple[str, str]] = []

    def start(self, key: str, transcript: str) -> None:
        self.started.append(key)
        code = extract_code(transcript)
        value = "error: no <code> block to run" if code is None else str(eval(code.removeprefix("print")))
        self._done.append((key, format_output(value, self.max_chars)))

    def ready(self, timeout_s: float) -> list[tuple[str, str]]:
        if self.hold:
            return []
        out, self._done = self._done, []
        return out

    def pending(self) -> int:
        return len(self._done)


def _driver(turns: dict[str, list[str]], max_calls: int = 2, max_chars: int = 64) -> tuple[
        MultiTurnEngine, ScriptedEngine, Calculator]:
    engine, calc = ScriptedEngine(turns), Calculator(max_chars)
    settings = ToolSettings(max_calls=max_calls, max_output_chars=max_chars, timeout_s=1.0)
    return MultiTurnEngine(engine, settings, calc, encode, decode, wait_s=0.0), engine, calc


def test_tool_output_is_appended_masked_and_versioned() -> None:
    driver, engine, calc = _driver({"a": ["<code>print(6*7)</code>", "#42" + EOS_TOKEN]})
    driver.submit([GenRequest("a", encode("6*7="), max_tokens=64)])
    assert driver.collect() == [] and driver.num_unfinished() == 1  # stopped at the call: not finished
    assert calc.started == ["a"]
    engine.update_weights({}, version=3)  # the answer turn is sampled by newer weights
    (res,) = driver.collect()
    first, output, answer = "<code>print(6*7)</code>", "\n<output>42</output>\n", "#42" + EOS_TOKEN
    assert decode(res.response_tokens) == first + output + answer
    n1, n2, n3 = len(encode(first)), len(encode(output)), len(encode(answer))
    assert res.loss_mask == [1] * n1 + [0] * n2 + [1] * n3
    assert res.logprobs == [-0.5] * n1 + [0.0] * n2 + [-0.5] * n3
    assert res.token_versions == [0] * n1 + [0] * n2 + [3] * n3  # tool tokens: version of '>' before them
    assert res.version == 0 and res.submitted_version == 0 and res.finish_reason == "stop"
    resumed = engine.submitted[1]  # resubmitted with everything so far as its prefix, same id and stop
    assert resumed.request_id == "a" and resumed.resume_tokens == res.response_tokens[: n1 + n2]
    assert resumed.stop == ("</code>",) and engine.submitted[0].stop == ("</code>",)
    assert driver.num_unfinished() == 0 and driver.tool_calls == 1


def test_calls_stop_at_max_calls() -> None:
    turns = {"a": ["<code>print(1)</code>", "<code>print(2)</code>", "#2" + EOS_TOKEN]}
    driver, _, calc = _driver(turns, max_calls=1)
    (res,) = generate_all(driver, [GenRequest("a", encode("x="), max_tokens=96)])
    text = decode(res.response_tokens)
    assert calc.started == ["a"] and text.count("<output>") == 1
    assert text.endswith("<code>print(2)</code>") and res.finish_reason == "stop"  # the second call is final
    assert sum(res.loss_mask) == len(res.response_tokens) - len("\n<output>1</output>\n")


def test_output_that_does_not_fit_ends_the_sample_at_the_budget() -> None:
    first = "<code>print(10**30)</code>"
    driver, _, _ = _driver({"a": [first, "#1" + EOS_TOKEN]})
    budget = len(first) + 10
    (res,) = generate_all(driver, [GenRequest("a", encode("x="), max_tokens=budget)])
    assert len(res.response_tokens) == budget and res.finish_reason == "length"
    assert res.loss_mask == [1] * len(first) + [0] * 10
    assert decode(res.response_tokens[len(first):]) == "\n<output>1"


def test_long_output_is_truncated() -> None:
    driver, _, _ = _driver({"a": ["<code>print(7**80)</code>", "#0" + EOS_TOKEN]}, max_chars=16)
    (res,) = generate_all(driver, [GenRequest("a", encode("x="), max_tokens=128)])
    assert "\n<output>" + str(7**80)[:13] + "...</output>\n" in decode(res.response_tokens)


def test_a_running_call_does_not_block_other_requests() -> None:
    driver, _, calc = _driver({"tool": ["<code>print(2+2)</code>", "#4" + EOS_TOKEN], "plain": ["#5" + EOS_TOKEN]})
    calc.hold = True
    driver.submit([GenRequest("tool", encode("2+2="), 64), GenRequest("plain", encode("5="), 64)])
    (done,) = driver.collect()
    assert done.request_id == "plain" and done.loss_mask == [1] * len(done.response_tokens)
    assert driver.pending_ids() == ["tool"] and driver.collect() == []  # output not back yet
    calc.hold = False
    (res,) = driver.collect()
    assert res.request_id == "tool" and decode(res.response_tokens).endswith("<output>4</output>\n#4" + EOS_TOKEN)


def test_abort_while_a_call_runs_returns_the_masked_partial() -> None:
    driver, _, calc = _driver({"a": ["<code>print(1)</code>"]})
    calc.hold = True
    driver.submit([GenRequest("a", encode("x="), 64)])
    driver.collect()
    (res,) = driver.abort(["a"])
    assert res.finish_reason == "abort" and res.loss_mask == [1] * len(res.response_tokens)
    calc.hold = False
    assert driver.collect() == [] and driver.num_unfinished() == 0  # the late output is dropped


def test_result_mask_length_is_checked() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        GenResult("a", [1, 2], [0.0, 0.0], "stop", [0, 0], 0, loss_mask=[1])


def test_a_request_moved_to_another_driver_keeps_its_mask_and_its_count_of_calls() -> None:
    """A flex worker gives back a request after one call (``EngineWorker.drain(release=True)``); resumed on
    another engine's driver it keeps its tool tokens masked and counts the call it made: with max_calls=1 there,
    its next call is not run.
    A request waiting on its tool is not movable (its output would be lost)."""
    turns = {"a": ["<code>print(6*7)</code>", "<code>print(1)</code>"], "b": ["<code>print(2)</code>"]}
    first, engine, calc = _driver(turns)
    first.submit([GenRequest("a", encode("6*7="), max_tokens=96), GenRequest("b", encode("2="), max_tokens=96)])
    calc.hold = True
    assert first.collect() == []  # both stopped at their first call; b's output is held back
    calc.hold = False
    calc._done = [d for d in calc._done if d[0] == "a"]
    engine.paused = True
    first.collect()  # a's output is appended and a resubmitted (running); b still waits on its call
    assert first.movable_ids() == ["a"]
    (partial,) = first.abort(first.movable_ids())
    n1, n2 = len(encode("<code>print(6*7)</code>")), len(encode("\n<output>42</output>\n"))
    assert partial.loss_mask == [1] * n1 + [0] * n2

    later = {"a": ["<code>print(1)</code>"]}
    second, _, calc2 = _driver(later, max_calls=1)
    (res,) = generate_all(second, [GenRequest("a", encode("6*7="), max_tokens=96).resumed(partial)])
    n3 = len(encode("<code>print(1)</code>"))
    assert res.loss_mask[: n1 + n2 + n3] == [1] * n1 + [0] * n2 + [1] * n3
    assert res.finish_reason == "stop" and len(res.loss_mask) == n1 + n2 + n3
    assert calc2.started == [], "the call made before the move was not counted"
