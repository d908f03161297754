"""The code tool's markup and its sandboxed call."""

from __future__ import annotations

from reflow.envs.tools import extract_code, format_output, output_spans, run_tool_call


def test_extract_code_takes_the_block_just_closed() -> None:
    assert extract_code("6*7=<code>print(6*7)</code>") == "print(6*7)"
    assert extract_code("<code>print(1)</code>\n<output>1</output>\n<code>x=2\nprint(x)</code>") == "x=2\nprint(x)"
    assert extract_code("no block</code>") is None
    assert extract_code("<code>a</code>b</code>") is None  # the last block closed twice: nothing open


def test_format_output_wraps_strips_and_truncates() -> None:
    assert format_output("56088\n", 64) == "\n<output>56088</output>\n"
    assert format_output("x" * 40, 16) == "\n<output>" + "x" * 13 + "...</output>\n"
    assert len(format_output("y" * 1000, 16)) == len("\n<output></output>\n") + 16


def test_output_spans_cover_each_appended_output() -> None:
    text = "<code>print(1)</code>\n<output>1</output>\n<code>print(2)</code>\n<output>2</output>\n#2"
    spans = output_spans(text)
    assert [text[a:b] for a, b in spans] == ["\n<output>1</output>\n", "\n<output>2</output>\n"]
    assert output_spans("12+7=19\n#19") == []


def test_run_tool_call_runs_the_block_in_the_sandbox() -> None:
    assert run_tool_call("123*456=<code>print(123*456)</code>", 2.0, 64) == "\n<output>56088</output>\n"
    crashed = run_tool_call("<code>print(undefined_name)</code>", 2.0, 200)
    assert crashed.startswith("\n<output>error: NameError") and crashed.endswith("</output>\n")
    assert run_tool_call("</code>", 2.0, 64) == "\n<output>error: no <code> block to run</output>\n"
    slow = run_tool_call("<code>while True: pass</code>", 0.5, 64)
    assert "timeout" in slow
