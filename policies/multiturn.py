"""Multi-turn tool use over any ``Engine``: stop at a code block, run it, append its output, continue.

``MultiTurnEngine`` wraps an engine and is one itself (same methods), so the
sync rounds (``EngineWorker.generate``), the streaming feeder
(``EngineWorker.drain``) and evaluation drive tool use without knowing it.
Per request:

1. It is submitted with the tool's stop string (``</code>``).
2. A result that ended on the stop string, with calls and tokens left, is
   not finished: its transcript (prompt + response text) goes to the
   ``ToolRunner`` (a Ray task per call in a run), which runs the code block
   just closed, and the engine keeps generating every other request meanwhile.
3. When the output is back, its tokens are appended to the response and the
   request is resubmitted with everything so far as its resume prefix
   (``GenRequest.resume_*``), under the same request id.
4. Anything else (EOS, token budget, abort, calls used up) is final and is
   returned with its ``loss_mask``.

Alignment of the appended tool-output tokens (``GenResult`` rules hold):

* ``loss_mask`` 0 (policy tokens 1), so they are never trained on;
* log-prob 0.0 (a placeholder: masked tokens never enter the loss);
* version: that of the policy token just before them (the one that closed
  the code block). A tool token is never older than a policy token of the
  same response, so ``GenResult.version`` (the minimum over all tokens) stays
  the oldest *policy* token's version and staleness is unchanged.

Budgets: ``max_tokens`` counts tool-output tokens too. An output that does
not fit is cut to the budget and the sample ends with finish reason
``length``. After ``max_calls`` calls a response that stops on ``</code>``
again is final (finish reason ``stop``, no output appended).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from reflow.policies.engines import Engine
from reflow.storage.schema import GenRequest, GenResult

TOOL_STOP = "</code>"  # same as envs.tools.CODE_CLOSE (infra does not import envs)


@dataclass(frozen=True)
class ToolSettings:
    """What the driver needs from ``ToolsConfig``."""

    max_calls: int
    max_output_chars: int
    timeout_s: float
    cpus_per_call: float = 0.0
    max_concurrent_calls: int = 4
    stop: str = TOOL_STOP


class ToolRunner(Protocol):
    """Runs tool calls in the background; the driver polls it."""

    def start(self, key: str, transcript: str) -> None:
        """Begin the call that ``transcript`` (prompt + response text, ending with the stop string) makes."""
        ...

    def ready(self, timeout_s: float) -> list[tuple[str, str]]:
        """``(key, text to append)`` of calls finished so far, waiting up to ``timeout_s`` for a first one."""
        ...

    def pending(self) -> int: ...


@dataclass
class _Turns:
    """A request's multi-turn state: the original request and the response so far."""

    request: GenRequest
    calls: int = 0
    mask: list[int] = dataclasses.field(default_factory=list)  # one entry per token of ``waiting``
    waiting: GenResult | None = None  # the result that stopped at a tool call, while the call runs


class MultiTurnEngine:
    """An ``Engine`` that runs tool calls between turns (see the module docstring)."""

    def __init__(self, engine: Engine, settings: ToolSettings, runner: ToolRunner,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 wait_s: float = 0.01) -> None:
        self.engine, self.settings, self.runner = engine, settings, runner
        self.encode, self.decode = encode, decode
        self.wait_s = wait_s  # longest block in ``collect`` when only tool calls are pending
        self._turns: dict[str, _Turns] = {}
        self._finished: list[GenResult] = []  # ended while appending a tool output (budget spent)
        self.tool_calls = 0  # calls started (a counter for metrics and tests)

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, requests: Sequence[GenRequest]) -> None:
        for req in requests:
            if req.request_id in self._turns:
                raise ValueError(f"request id {req.request_id!r} is already running")
            mask = [1] * len(req.resume_tokens) if req.resume_mask is None else list(req.resume_mask)
            # a request resumed from another engine: its calls so far are the tool outputs in its mask
            calls = sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))
            self._turns[req.request_id] = _Turns(req, calls=calls, mask=mask)
        self.engine.submit([dataclasses.replace(r, stop=tuple(dict.fromkeys((*r.stop, self.settings.stop))))
                            for r in requests])

    def num_unfinished(self) -> int:
        return len(self._turns)

    def pending_ids(self) -> list[str]:
        return list(self._turns)

    def movable_ids(self) -> list[str]:
        """The requests that can be aborted and resumed elsewhere: those not waiting on a tool call (its output
        would be lost)."""
        return [r for r, turns in self._turns.items() if turns.waiting is None]

    def collect(self, max_steps: int = 1) -> list[GenResult]:
        """Resubmit requests whose tool output is back, step the engine, sort results into calls and finals."""
        wait = 0.0 if self.engine.num_unfinished() else self.wait_s
        for key, text in self.runner.ready(wait):
            self._resume(key, text)
        done, self._finished = self._finished, []
        if not self.engine.num_unfinished():
            return done
        for res in self.engine.collect(max_steps=max_steps):
            turns = self._turns[res.request_id]
            res = dataclasses.replace(res, loss_mask=_extend(turns.mask, len(res.response_tokens)))
            if self._is_call(turns, res):
                turns.calls += 1
                turns.waiting, turns.mask = res, res.mask()
                self.tool_calls += 1
                self.runner.start(res.request_id,
                                  self.decode(list(turns.request.prompt_tokens) + res.response_tokens))
            else:
                del self._turns[res.request_id]
                done.append(res)
        return done

    def _is_call(self, turns: _Turns, res: GenResult) -> bool:
        """Whether ``res`` stopped on the tool stop string with a call and a token left to spend."""
        if res.finish_reason != "stop" or turns.calls >= self.settings.max_calls:
            return False
        if len(res.response_tokens) >= turns.request.max_tokens:
            return False
        tail = self.decode(res.response_tokens[-len(self.settings.stop) - 4:])
        return tail.endswith(self.settings.stop)

    def _resume(self, key: str, text: str) -> None:
        """Append a tool output (mask 0, log-prob 0, the closing token's version) and resubmit."""
        turns = self._turns.get(key)
        if turns is None or turns.waiting is None:  # aborted while the call ran
            return
        res, turns.waiting = turns.waiting, None
        budget = turns.request.max_tokens - len(res.response_tokens)
        out = self.encode(text)[:budget]
        tokens = res.response_tokens + out
        logprobs = res.logprobs + [0.0] * len(out)
        versions = res.token_versions + [res.token_versions[-1]] * len(out)
        mask = turns.mask + [0] * len(out)
        if len(tokens) >= turns.request.max_tokens:  # no room left to answer
            del self._turns[key]
            self._finished.append(GenResult(key, tokens, logprobs, "length", versions, res.submitted_version, mask))
            return
        turns.mask = mask
        self.engine.submit([dataclasses.replace(
            turns.request, resume_tokens=tokens, resume_logprobs=logprobs, resume_versions=versions,
            submitted_version=res.submitted_version, stop=(self.settings.stop,), resume_mask=mask)])

    def abort(self, request_ids: Sequence[str]) -> list[GenResult]:
        """Abort generating requests and drop waiting tool calls' requests; their partial results (masked)."""
        ids = [r for r in request_ids if r in self._turns]
        waiting = {r for r in ids if self._turns[r].waiting is not None}
        out = []
        for res in self.engine.abort([r for r in ids if r not in waiting]):
            turns = self._turns.pop(res.request_id)
            out.append(dataclasses.replace(res, loss_mask=_extend(turns.mask, len(res.response_tokens))))
        for r in waiting:  # the call's output, when it comes, is ignored
            turns = self._turns.pop(r)
            out.append(dataclasses.replace(turns.waiting, finish_reason="abort", loss_mask=turns.mask))
        return out

    def update_weights(self, state: dict[str, Any], version: int) -> None:
        self.engine.update_weights(state, version)

    def rest(self) -> bool:
        """The wrapped engine's ``rest``, once no request is in flight or waiting on its tool."""
        return not self._turns and self.engine.rest()


def _extend(mask: list[int], n: int) -> list[int]:
    """``mask`` fitted to ``n`` tokens: tokens past it are the policy's (1)."""
    return mask[:n] + [1] * (n - len(mask))
