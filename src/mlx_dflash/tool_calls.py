"""Tool calls in a chat reply: the generated text split into content and OpenAI tool calls.

A model with tool calling (mlx-lm's tokenizer knows its markers and parser from the chat
template: ``tool_call_start``, ``tool_call_end``, ``tool_parser``) writes each call between the
two markers. ``ToolCallText`` takes the reply as it streams and returns the content to send
now (holding back what may begin a marker) and the calls completed now, as mlx-lm's server
formats them. A call that does not parse stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` begin ``marker`` (they may be its start)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallText:
    def __init__(self, tokenizer: Any, tools: Optional[list], streaming: bool = False):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parser, self.tools = tokenizer.tool_parser, tools
        self.streaming = streaming  # stream deltas number their calls (``index``)
        self.pending = ""  # text not given out yet: a call under way, or what may begin the start marker
        self.inside = False
        self.count = 0  # calls given out so far

    def add(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, tool calls completed now) after ``text``."""
        self.pending += text
        content, calls = "", []
        while True:
            marker = self.end if self.inside else self.start
            at = self.pending.find(marker) if marker else -1  # (no end marker: a call runs to the reply's end)
            if at < 0:
                break
            before, self.pending = self.pending[:at], self.pending[at + len(marker):]
            if self.inside:
                parsed, failed = self._parse(before)
                calls += parsed
                content += failed
            else:
                content += before
            self.inside = not self.inside
        if not self.inside:
            keep = len(self.pending) - _partial_marker(self.pending, self.start)
            content, self.pending = content + self.pending[:keep], self.pending[keep:]
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """The reply ended: what was held back is content; a call without its end marker is
        parsed as it stands (mlx-lm's server does the same)."""
        text, self.pending = self.pending, ""
        if not self.inside:
            return text, []
        self.inside = False
        calls, failed = self._parse(text, closed=False)
        return failed, calls

    def whole(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls) of a whole reply."""
        (content, calls), (rest, more) = self.add(text), self.finish()
        return content + rest, calls + more

    def _parse(self, text: str, closed: bool = True) -> tuple[list[dict], str]:
        """(the calls in one marked span, or none and the span as written when it does not parse)."""
        try:
            parsed = self.parser(text, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [{"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": str(call["name"]), "arguments": _arguments(call.get("arguments", {}))}}
                     for call in parsed]
        except (ValueError, KeyError, TypeError, AttributeError):  # (json.JSONDecodeError is a ValueError)
            return [], self.start + text + (self.end if closed else "")
        for call in calls:
            if self.streaming:
                call["index"] = self.count
            self.count += 1
        return calls, ""


def _arguments(arguments: Any) -> str:
    """A call's arguments as OpenAI sends them: a JSON string."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
