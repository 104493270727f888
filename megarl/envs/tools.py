"""Tools the model can call, by name: a calculator, a Python executor (in the sandbox), and a registry for user tools.

A tool is a function of keyword arguments returning text (what the model sees in the tool response), plus the JSON
schema the chat template shows the model. Tool failures are answers, not exceptions: the model sees "error: ..." and
the episode goes on.
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Callable


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the keyword arguments
    fn: Callable[..., str]
    sandboxed: bool = False  # runs model-written code: the environment checks the sandbox works before any episode

    def schema(self) -> dict:
        """The OpenAI-style tool description chat templates render (tools=[...])."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS: dict[str, Tool] = {}


def register_tool(tool: Tool) -> Tool:
    TOOLS[tool.name] = tool
    return tool


def resolve_tools(names: list[str]) -> list[Tool]:
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"env.tools: unknown tool(s) {unknown}; choose from {sorted(TOOLS)} or register your own "
                         "with megarl.envs.register_tool")
    return [TOOLS[n] for n in names]


# ------------------------------------------------------------------------------------------------ calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node):
    """Arithmetic on numbers only (an AST walk, never eval): no names, calls or attributes can run."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate + - * / // % ** and parentheses over numbers; integers stay exact."""
    if not isinstance(expression, str) or len(expression) > 200:
        return "error: expression must be a string of at most 200 characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


register_tool(Tool("calculator", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                   {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                   calculator))


# ------------------------------------------------------------------------------------------------ python
def python(code: str) -> str:
    """Run code in the sandbox (megarl.sandbox: bubblewrap, a minimal root with no host paths, own namespaces,
    per-execution limits); the answer is its stdout, or the reason it failed."""
    from ..sandbox import run_python

    if not isinstance(code, str):
        return "error: code must be a string"
    result = run_python(code)
    if result.ok:
        return result.stdout[-2000:]
    return f"error: {result.reason}\n{result.stderr[-1000:]}".rstrip()


register_tool(Tool("python", "Run a Python program in a sandbox (no network) and return what it prints.",
                   {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, python,
                   sandboxed=True))
