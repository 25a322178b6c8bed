"""The grammar of the symbolic-size strings a stage archive may hand to sympy.

torch.export writes every symbolic size as ``sympy.srepr`` text, e.g.
``Add(Symbol('s28', positive=True, integer=True), Integer(16))``, and its loader gives that
string to ``sympy.sympify``, which *evaluates* it as Python: any code in it runs. So before
torch sees an archive, every such string must parse (with Python's ``ast``, never evaluated)
as a tree of exactly these forms:

- ``Symbol('<name>', <flag>=True|False, ...)``: a name like ``s72`` or ``u0``; flags from
  ``FLAGS``;
- ``Integer(<int>)`` and ``Rational(<int>, <int>)``: integer literals, possibly negative;
- ``<F>(<expr>, ...)`` with ``F`` in ``FUNCTIONS``: the integer arithmetic, comparisons and
  logic that torch's shape code writes, each argument itself one of these forms.

Nothing else: no attribute access, subscript, operator, lambda, comprehension, string outside
``Symbol``'s name, keyword outside ``FLAGS``, or unknown name. The lists are what torch 2.13
writes for autopart's programs (Symbol, Integer, Add, Mul, Pow, FloorDiv, Max and Min were seen
in the programs of nanoGPT, the Hugging Face GPT-2 and Llama examples and every architecture of
``autopart.models.zoo``, under dp, tp, pp, Seq1F1B, zero-bubble, recompute and bf16 plans)
plus the integer functions of the same family; a torch that writes another form is refused, by
name, until it is added here.
"""

from __future__ import annotations

import ast
import re

# sympy's and torch's (torch.utils._sympy.functions) integer-valued and boolean constructors
FUNCTIONS = frozenset(
    {
        "Add",
        "Mul",
        "Pow",
        "Max",
        "Min",
        "Mod",
        "Abs",
        "FloorDiv",
        "CeilDiv",
        "CleanDiv",
        "PythonMod",
        "ModularIndexing",
        "PowByNatural",
        "Eq",
        "Ne",
        "StrictLessThan",
        "LessThan",
        "StrictGreaterThan",
        "GreaterThan",
        "And",
        "Or",
        "Not",
    }
)
FLAGS = frozenset({"positive", "integer", "nonnegative"})
SYMBOL = re.compile(r"[a-z]{1,8}[0-9]{1,12}")  # torch's symbols: s0, u3, ...
MAX_LEN = 1 << 14  # characters of one expression
MAX_NODES = 4096  # calls and literals in one expression
MAX_DEPTH = 48  # nesting of calls
MAX_INT = 1 << 63  # the magnitude of an integer literal


class BadExpression(ValueError):
    """A symbolic-size string outside the grammar (the message says what was found)."""


def check_expression(text: object) -> None:
    """Raise ``BadExpression`` unless ``text`` is a symbolic size of the grammar above."""
    if not isinstance(text, str):
        raise BadExpression(f"is a {type(text).__name__}, not a string")
    if len(text) > MAX_LEN:
        raise BadExpression(f"is {len(text)} characters long (at most {MAX_LEN})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise BadExpression(f"does not parse ({type(exc).__name__})") from None
    count = [0]
    _expr(tree.body, 0, count)


def _int(node: ast.expr) -> int:
    """An integer literal: ``5`` or ``-5``."""
    sign = 1
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        sign, node = -1, node.operand
    if not isinstance(node, ast.Constant) or type(node.value) is not int:
        raise BadExpression(f"has {_show(node)} where an integer literal must be")
    if abs(node.value) > MAX_INT:
        raise BadExpression(f"has an integer literal beyond ±2**63 ({_show(node)})")
    return sign * node.value


def _expr(node: ast.expr, depth: int, count: list[int]) -> None:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise BadExpression(f"has more than {MAX_NODES} terms")
    if depth > MAX_DEPTH:
        raise BadExpression(f"nests deeper than {MAX_DEPTH}")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise BadExpression(f"has {_show(node)}, which is not a call of a sympy constructor")
    name = node.func.id
    if name == "Symbol":
        _symbol(node)
        return
    if node.keywords:
        raise BadExpression(f"passes keywords to {name}")
    if name == "Integer":
        if len(node.args) != 1:
            raise BadExpression("has an Integer(...) of other than one argument")
        _int(node.args[0])
        return
    if name == "Rational":
        if len(node.args) != 2:
            raise BadExpression("has a Rational(...) of other than two arguments")
        _int(node.args[0]), _int(node.args[1])
        return
    if name not in FUNCTIONS:
        raise BadExpression(
            f"calls {name[:40]!r}, which is not a sympy constructor autopart allows"
        )
    if not node.args:
        raise BadExpression(f"calls {name} without arguments")
    for arg in node.args:
        _expr(arg, depth + 1, count)


def _symbol(node: ast.Call) -> None:
    if len(node.args) != 1:
        raise BadExpression("has a Symbol(...) of other than one name")
    (arg,) = node.args
    if not (
        isinstance(arg, ast.Constant) and isinstance(arg.value, str) and SYMBOL.fullmatch(arg.value)
    ):
        raise BadExpression(f"has the symbol name {_show(arg)} (names like 's72' only)")
    for kw in node.keywords:
        if kw.arg not in FLAGS:
            raise BadExpression(f"passes {kw.arg or '**'!s} to Symbol (only {sorted(FLAGS)})")
        if not (isinstance(kw.value, ast.Constant) and type(kw.value.value) is bool):
            raise BadExpression(f"sets Symbol's {kw.arg} to {_show(kw.value)}, not True/False")


def _show(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # noqa: BLE001 - only for the message
        text = type(node).__name__
    return repr(text[:60])
