"""vLLM's tool parser behind the gateway's function calling.

Owns: ``VllmToolParser`` (the parser rollout.tool_call_parser names, its class looked
up once in vLLM's ``ToolParserManager``; for each request with tools, a
``ChatCompletionRequest`` and a parser instance made as vLLM's own chat serving makes
them, the parser's ``adjust_request`` applied, and its ``extract_tool_calls`` run on the
completion's text) and ``parser_names`` (the installed vLLM's tool parsers, for the
config check). The rollout worker builds the parser and hands it to the gateway, whose
own modules import no vLLM (``workers.rollout.tool_calls`` is what the gateway does
with it); vLLM is imported inside the functions.
"""

from __future__ import annotations

import logging
from typing import Any

from workers.rollout.openai_format import ApiError, ToolCall

log = logging.getLogger("async_rl.gateway")


def parser_names() -> list[str]:
    """The tool parsers of the installed vLLM (what ``--tool-call-parser`` takes)."""
    from vllm.tool_parsers import ToolParserManager

    return list(ToolParserManager.list_registered())


class VllmParserTurn:
    """One request's parsing: vLLM's request and a parser instance of its own."""

    def __init__(self, parser: Any, request: Any) -> None:
        self._parser, self._request = parser, request
        self.tools: list[dict[str, Any]] = [tool.model_dump() for tool in request.tools]
        """The tools as vLLM's server renders them (its models' dump)."""
        self.parse = request.tool_choice != "none"
        self.skip_special_tokens = bool(request.skip_special_tokens)

    def calls(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """See ``workers.rollout.tool_calls.ParserTurn``. Content that is only
        whitespace is none, as vLLM's server has it."""
        try:
            found = self._parser.extract_tool_calls(text, self._request)
        except Exception:  # the parser's failure, not the request's: the text stays content
            log.debug("tool parser %s failed on a completion", type(self._parser).__name__,
                      exc_info=True)
            return text, ()
        if not found.tools_called:
            return text, ()
        content = found.content if found.content and found.content.strip() else ""
        return content, tuple(ToolCall(id=call.id, name=call.function.name,
                                       arguments=call.function.arguments)
                              for call in found.tool_calls)


class VllmToolParser:
    """vLLM's tool parser ``name`` (rollout.tool_call_parser) over ``tokenizer``; raises
    when vLLM has no such parser or it cannot use the tokenizer (vLLM's server checks the
    same at its start)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        self._class: Any = ToolParserManager.get_tool_parser(name)
        self._tokenizer = tokenizer
        self._class(tokenizer)  # a tokenizer the parser cannot use fails here, as in vLLM

    def turn(self, tools: Any, choice: str, model: str) -> VllmParserTurn:
        """A request's parsing, set up as vLLM's chat serving does: its request (the
        tools checked: 400 naming them) and a parser instance, which adjusts it."""
        import pydantic
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest.model_validate(
                {"model": model, "messages": [], "tools": tools, "tool_choice": choice})
        except pydantic.ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                            for e in err.errors())
            raise ApiError(400, f"invalid tools: {why}", param="tools",
                           code="invalid_value") from None
        parser = self._class(self._tokenizer, request.tools)
        return VllmParserTurn(parser, parser.adjust_request(request))
