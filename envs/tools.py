"""The code-interpreter tool of multi-turn rollouts (ReTool-style): its markup and its one call.

A response may contain code blocks. Generation stops right after a block's
closing tag; the block runs in the sandbox (``envs.sandbox.run_program``) and
its output is appended to the response, then generation continues::

    <code>print(123*456)</code>            <- written by the policy, generation stops here
    <output>56088</output>                 <- appended (tool output, masked out of the loss)
    #56088                                 <- written by the policy

The appended text is ``format_output(...)``: a newline, ``<output>``, the
program's stdout (on failure: its status and the last line of stderr), cut to
``max_chars`` characters, ``</output>`` and a newline. The control code that
drives the turns is ``policies.multiturn``; this module is pure text plus the
sandbox call, so it runs anywhere (a Ray task, a test).
"""

from __future__ import annotations

from reflow.envs.sandbox import SandboxLimits, run_program

CODE_OPEN = "<code>"
CODE_CLOSE = "</code>"  # the stop string of a tool-using request
OUTPUT_OPEN = "<output>"
OUTPUT_CLOSE = "</output>"
TRUNCATED = "..."


def extract_code(text: str) -> str | None:
    """The code of the last block of ``text`` (which ends with ``</code>``); None if no block opens.

    ``text`` is prompt plus response so far, so a block opened in the prompt
    counts too.
    """
    body = text.removesuffix(CODE_CLOSE)
    start = body.rfind(CODE_OPEN)
    if start < 0 or body.rfind(CODE_CLOSE) > start:
        return None
    return body[start + len(CODE_OPEN):]


def format_output(text: str, max_chars: int) -> str:
    """The text appended after a code block: ``"\\n<output>" + text (cut to max_chars) + "</output>\\n"``."""
    text = text.strip()
    if len(text) > max_chars:
        text = text[: max(0, max_chars - len(TRUNCATED))] + TRUNCATED
    return f"\n{OUTPUT_OPEN}{text}{OUTPUT_CLOSE}\n"


def output_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of appended tool outputs in a response text (for masking)."""
    spans, pos = [], 0
    while (start := text.find("\n" + OUTPUT_OPEN, pos)) >= 0:
        end = text.find(OUTPUT_CLOSE + "\n", start)
        end = len(text) if end < 0 else end + len(OUTPUT_CLOSE) + 1
        spans.append((start, end))
        pos = end
    return spans


def run_tool_call(transcript: str, timeout_s: float, max_chars: int) -> str:
    """Run the code block that ``transcript`` just closed in the sandbox; the text to append.

    A missing block, a crash or a timeout is reported in the output (the
    policy sees it), never raised.
    """
    code = extract_code(transcript)
    if code is None:
        return format_output("error: no <code> block to run", max_chars)
    limits = SandboxLimits(cpu_seconds=timeout_s, wall_seconds=timeout_s + 1.0,
                           max_output_bytes=max(1024, 4 * max_chars))
    result = run_program(code, "", limits)
    if result.status == "ok":
        return format_output(result.stdout, max_chars)
    last = result.stderr.strip().splitlines()[-1:] or [result.status]
    return format_output(f"{result.stdout.strip()}\n{result.status}: {last[0]}".strip(), max_chars)
