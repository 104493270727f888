"""A tool-use environment: the model calls tools with its chat template's tool-call syntax, the environment runs them
and answers with tool messages; a turn without a tool call is the final answer (scored by the reward function).

Tool calls are parsed by SGLang's own function-call parsers (`tool_call_format`, e.g. "qwen25": <tool_call> JSON
blocks), the ones its OpenAI-compatible server uses for the same models.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

from ..sandbox import SandboxUnavailable, check_sandbox
from .base import EnvStep, register_env
from .tools import Tool, resolve_tools


@dataclass
class ToolCall:
    name: str
    arguments: dict


class ToolCallParser:
    def __init__(self, tools: list[Tool], fmt: str = "qwen25"):
        from sglang.srt.entrypoints.openai.protocol import Function, Tool as SGLangTool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        if fmt not in FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"env.tool_call_format={fmt!r} is unknown to SGLang; choose one of "
                             f"{sorted(FunctionCallParser.ToolCallParserEnum)}")
        self.detector = FunctionCallParser.ToolCallParserEnum[fmt]()
        self.tools = [SGLangTool(type="function", function=Function(name=t.name, description=t.description,
                                                                     parameters=t.parameters)) for t in tools]
        # a policy early in training writes malformed calls often; SGLang logs each one (the env counts them instead)
        logging.getLogger(type(self.detector).__module__).setLevel(logging.ERROR)
        logging.getLogger("sglang.srt.function_call.base_format_detector").setLevel(logging.ERROR)

    def attempted(self, text: str) -> bool:
        return self.detector.has_tool_call(text)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for item in self.detector.detect_and_parse(text, self.tools).calls:
            try:
                arguments = json.loads(item.parameters) if item.parameters else {}
            except json.JSONDecodeError:
                arguments = None
            calls.append(ToolCall(item.name, arguments if isinstance(arguments, dict) else {}))
        return calls


@functools.lru_cache(maxsize=8)
def _parser(tool_names: tuple[str, ...], fmt: str) -> ToolCallParser:
    return ToolCallParser(resolve_tools(list(tool_names)), fmt)


@register_env("tool")
class ToolEnv:
    """Each model turn: tool calls -> run them, answer with one tool message per call; no tool call -> done.
    info counts tool_calls, tool_errors (a tool answered "error: ..."), bad_tool_calls (tool-call syntax that did not
    parse into a known tool with valid arguments)."""

    def __init__(self, tools: list[str], tool_call_format: str = "qwen25", max_calls_per_turn: int = 4):
        self.tools = {t.name: t for t in resolve_tools(list(tools))}
        if any(t.sandboxed for t in self.tools.values()):
            check_sandbox()  # fail closed: SandboxUnavailable, never model code on the host (cached per process)
        self.parser = _parser(tuple(tools), tool_call_format)
        self.max_calls_per_turn = max_calls_per_turn

    def reset(self, record) -> None:
        self.record = record

    def step(self, turn_text: str) -> EnvStep:
        if not self.parser.attempted(turn_text):
            return EnvStep(observation=None, done=True, info={"tool_calls": 0})
        calls = self.parser.parse(turn_text)[: self.max_calls_per_turn]
        if not calls:
            return EnvStep(observation=[{"role": "tool", "content": "error: the tool call could not be parsed"}],
                           info={"tool_calls": 0, "bad_tool_calls": 1})
        messages, errors = [], 0
        for call in calls:
            answer = self._run(call)
            errors += answer.startswith("error:")
            messages.append({"role": "tool", "name": call.name, "content": answer})
        return EnvStep(observation=messages, info={"tool_calls": len(calls), "tool_errors": errors})

    def _run(self, call: ToolCall) -> str:
        tool = self.tools[call.name]  # the parser keeps only calls of known tools
        try:
            return str(tool.fn(**call.arguments))
        except SandboxUnavailable:
            raise  # no isolation: stop, never run model code unisolated
        except TypeError as e:  # wrong or missing arguments
            return f"error: {e}"
        except Exception as e:  # any other tool failure is the model's observation; the episode goes on
            return f"error: {type(e).__name__}: {e}"
