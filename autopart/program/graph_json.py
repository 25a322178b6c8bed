"""The schema of a stage archive's ``models/model.json``: what autopart's stage graphs hold.

torch.export's loader turns this JSON back into a graph. Several of its strings reach code that
evaluates or resolves them: symbolic sizes go to ``sympy.sympify`` (Python ``eval``), call
targets and ``source_fn_stack`` entries are resolved by attribute lookup, pytree contexts may
name a module for ``importlib.import_module``, ``as_graph`` / ``as_custom_obj`` / ``as_operator``
arguments bring subgraphs, objects and callables. So the whole document is checked against an
allow-list of what autopart's own archives contain (``check_model``) before torch reads it:

- every object has only the fields torch's schema gives it, of the right JSON types; tagged
  unions use only the kinds autopart's programs use (plain tensors, numbers, strings, lists and
  symbolic sizes; never subgraphs, custom objects, operators or non-user inputs and outputs);
- every symbolic size parses in the grammar of ``symexpr`` (never evaluated here);
- every call target is an ATen or autopart op or one of a few Python operators on sizes;
- node metadata holds only ``stack_trace``, ``nn_module_stack``, ``torch_fn``, ``from_node``
  (provenance records kept as text) and autopart's ``custom`` annotations; the call signature's pytree specs name only tuple, list and dict, with
  the contexts torch writes for them; no guard code, no custom objects, no extra metadata.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from autopart.layout import BUILTIN_OPS as BUILTIN
from autopart.meta import META_LAYER, META_MODULE, META_RECOMPUTE
from autopart.program.schema import (
    DOTTED,
    NAME,
    Invalid,
    Spec,
    anything,
    boolean,
    dict_of,
    integer,
    list_of,
    nullable,
    obj,
    one_of,
    parse_json,
    string,
    union,
)
from autopart.program.symexpr import BadExpression, check_expression

# ---- call targets -----------------------------------------------------------------------------

NAMESPACES = BUILTIN  # what a stage graph may call; a load may trust library namespaces too
_OP = re.compile(
    r"torch\.ops\.([A-Za-z][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)"
)
# ATen ops named after Python operators (aten.__and__.Tensor); no other dunder is an op name
_OPERATOR_DUNDERS = frozenset(
    f"__{i}{op}__" for op in ("and", "or", "xor", "lshift", "rshift") for i in ("", "i")
)
PYTHON_OPS = frozenset(
    {
        f"_operator.{f}"
        for f in (
            "add",
            "sub",
            "mul",
            "floordiv",
            "truediv",
            "mod",
            "pow",
            "neg",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "getitem",
            "and_",
            "or_",
        )
    }
    | {
        f"torch.{f}"
        for f in (
            "sym_max",
            "sym_min",
            "sym_not",
            "sym_float",
            "sym_int",
            "sym_ite",
            "sym_sum",
            "sym_sqrt",
        )
    }
)


def allowed(target: str, namespaces: Sequence[str] | None = NAMESPACES) -> bool:
    """A serialized call target autopart's stage graphs may use: ``torch.ops.<ns>.<op>.<overload>``
    for a namespace in ``namespaces`` (None: any; ATen and autopart's by default; no dunder
    names beyond the operator ops such as ``__and__``), or a Python size operator."""
    m = _OP.fullmatch(target)
    if m is not None:
        ns, op, overload = m.groups()
        return (
            (namespaces is None or ns in namespaces)
            and (not op.startswith("__") or op in _OPERATOR_DUNDERS)
            and not overload.startswith("_")
        )
    return target in PYTHON_OPS


def _target(value: Any, where: str) -> None:
    """The target's form; ``check_model`` then checks its namespace against the trusted ones."""
    string(max_len=256)(value, where)
    if not allowed(value, None):
        raise Invalid(
            where,
            f"means a node calls {value[:80]!r}, which is not an ATen op, an autopart op, a "
            "library op or a Python operator on sizes",
        )


# ---- symbolic sizes ---------------------------------------------------------------------------


def _expression(value: Any, where: str) -> None:
    try:
        check_expression(value)
    except BadExpression as exc:
        raise Invalid(where, f"is a symbolic size that {exc}; it was not evaluated") from None


SYMBOL_NAME = re.compile(r"[a-z]{1,8}[0-9]{1,12}")
_I64 = integer(-(1 << 63), (1 << 63) - 1)
_NAME = string(NAME)
_SYM_EXPR = obj(
    {"expr_str": _expression},
    {"hint": nullable(union({"as_int": _I64, "as_bool": boolean}))},
)
_SYM_INT = union({"as_expr": _SYM_EXPR, "as_int": _I64})
_SYM_BOOL = union({"as_expr": _SYM_EXPR, "as_bool": boolean})

# ---- arguments --------------------------------------------------------------------------------

_FLOAT_WORDS = re.compile(r"-?(Infinity|inf|NaN|nan)")


def _float(value: Any, where: str) -> None:
    """torch writes a float as a JSON number, or as a string for infinities and NaN."""
    if isinstance(value, bool):
        raise Invalid(where, "must be a number, not bool")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise Invalid(where, "must be finite or written as a string")
        return
    if isinstance(value, str) and _FLOAT_WORDS.fullmatch(value):
        return
    raise Invalid(where, f"must be a number, not {type(value).__name__}")


_TENSOR = obj({"name": _NAME})
_ENUM = integer(0, 64)  # ScalarType, Layout, MemoryFormat: looked up in torch's tables
_DEVICE = obj({"type": one_of("cpu", "cuda", "meta")}, {"index": nullable(integer(0, 1 << 16))})
_SYM_INT_ARG = union({"as_name": _NAME, "as_int": _I64})
_SYM_BOOL_ARG = union({"as_name": _NAME, "as_bool": boolean})
_SYM_FLOAT_ARG = union({"as_name": _NAME, "as_float": _float})
_OPT_TENSOR = union({"as_tensor": _TENSOR, "as_none": boolean})
_STRING = string(max_len=4096)

# the kinds of argument whose value is plain data; never "as_graph" (a subgraph with its own
# call targets), "as_custom_obj" (an object by class name) or "as_operator" (a callable by name)
ARGUMENT = union(
    {
        "as_none": boolean,
        "as_tensor": _TENSOR,
        "as_tensors": list_of(_TENSOR),
        "as_optional_tensor": _OPT_TENSOR,
        "as_optional_tensors": list_of(_OPT_TENSOR),
        "as_int": _I64,
        "as_ints": list_of(_I64),
        "as_int_lists": list_of(list_of(_I64)),
        "as_float": _float,
        "as_floats": list_of(_float),
        "as_float_lists": list_of(list_of(_float)),
        "as_bool": boolean,
        "as_bools": list_of(boolean),
        "as_string": _STRING,
        "as_strings": list_of(_STRING),
        "as_sym_int": _SYM_INT_ARG,
        "as_sym_ints": list_of(_SYM_INT_ARG),
        "as_sym_bool": _SYM_BOOL_ARG,
        "as_sym_bools": list_of(_SYM_BOOL_ARG),
        "as_sym_float": _SYM_FLOAT_ARG,
        "as_sym_floats": list_of(_SYM_FLOAT_ARG),
        "as_scalar_type": _ENUM,
        "as_memory_format": _ENUM,
        "as_layout": _ENUM,
        "as_device": _DEVICE,
        "as_complex": obj({"real": _float, "imag": _float}),
    }
)

# ---- node metadata ----------------------------------------------------------------------------


_MODULE = re.compile(f"(?:{DOTTED.pattern})?")  # "" for the top level
_CUSTOM = obj(
    {},
    {
        META_MODULE: string(_MODULE, 1024),
        META_LAYER: nullable(integer(0, 1 << 20)),
        META_RECOMPUTE: integer(0, 1 << 20),
        # torch's own annotation of code run under torch._dynamo.disable while exporting
        "_torchdynamo_disable": boolean,
        "_torchdynamo_disable_recursive": boolean,
        "_torchdynamo_disable_method": string(max_len=256),
    },
)


def _embedded(value: str, where: str) -> Any:
    """A JSON document torch wrote as a string value: read as the files are (``parse_json``)."""
    try:
        return parse_json(value)
    except Invalid as exc:
        raise Invalid(where, f"is not JSON ({exc.why})") from None


def _custom(value: Any, where: str) -> None:
    """autopart's annotations, as a JSON string: module, layer, recompute region (and the
    markers torch adds to code under ``torch._dynamo.disable``)."""
    string()(value, where)
    doc = _embedded(value, where)
    _CUSTOM(doc, where)


def _from_node(value: Any, where: str) -> None:
    """Where a node came from (torch's provenance records), as a JSON string: names, targets
    and pass names kept as text, never resolved."""
    string(max_len=1 << 20)(value, where)
    doc = _embedded(value, where)
    _sources(doc, where, 0)


def _sources(value: Any, where: str, depth: int) -> None:
    if depth > 32:
        raise Invalid(where, "nests deeper than 32")
    list_of(anything, 1 << 12)(value, where)
    for i, source in enumerate(value):
        at = f"{where}[{i}]"
        _SOURCE(source, at)
        _sources(source["from_node"], f"{at}.from_node", depth + 1)


_SOURCE = obj(
    {
        "name": string(max_len=1024),
        "target": string(max_len=1024),
        "graph_id": _I64,
        "pass_name": string(max_len=1024),
        "action": string(max_len=256),
        "from_node": list_of(anything),
    }
)

_METADATA = obj(
    {},
    {
        "stack_trace": string(),  # kept as text
        "from_node": _from_node,
        "nn_module_stack": string(),  # split on ';' and ',' into strings, never resolved
        "torch_fn": string(max_len=4096),  # split on ';' into strings
        "custom": _custom,
    },
)

_NODE = obj(
    {
        "target": _target,
        # kind: 1 positional, 2 keyword, as torch writes it; without it torch guesses from the
        # op's schema, which a random fuzz run showed can load another graph than was saved
        "inputs": list_of(obj({"name": _NAME, "arg": ARGUMENT, "kind": one_of(1, 2)})),
        "outputs": list_of(ARGUMENT),
        "metadata": _METADATA,
    },
    {"is_hop_single_tensor_return": nullable(boolean), "name": nullable(_NAME)},
)

_TENSOR_META = obj(
    {
        "dtype": _ENUM,
        "sizes": list_of(_SYM_INT, 64),
        "requires_grad": boolean,
        "device": _DEVICE,
        "strides": list_of(_SYM_INT, 64),
        "storage_offset": _SYM_INT,
        "layout": _ENUM,
    }
)

_GRAPH = obj(
    {
        "inputs": list_of(ARGUMENT),
        "outputs": list_of(ARGUMENT),
        "nodes": list_of(_NODE),
        "tensor_values": dict_of(_TENSOR_META, key=_NAME),
        "sym_int_values": dict_of(_SYM_INT, key=_NAME),
        "sym_bool_values": dict_of(_SYM_BOOL, key=_NAME),
    },
    {
        "is_single_tensor_return": boolean,
        "custom_obj_values": dict_of(boolean, max_len=0),  # none: torch would make objects
        "sym_float_values": dict_of(union({"as_expr": _SYM_EXPR, "as_float": _float}), key=_NAME),
    },
)

# ---- the call signature's pytree specs --------------------------------------------------------

MAX_CONTEXT = 1 << 16

_LEAF: dict[str, Any] = {"type": None, "context": None, "children_spec": []}


def _treespec_node(spec: Any, where: str, depth: int) -> None:
    """A pytree spec as torch writes a call signature: leaves, tuples and lists (context
    ``"null"``) and dicts (context: a JSON list of string keys). Contexts are parsed by torch
    with a hook that imports any module a ``"__enum__"`` object names, so nothing else passes."""
    if depth > 32:
        raise Invalid(where, "nests deeper than 32")
    obj({"type": nullable(string(max_len=64)), "context": anything, "children_spec": anything})(
        spec, where
    )
    kind, context, children = spec["type"], spec["context"], spec["children_spec"]
    if kind is None:
        if spec != _LEAF:
            raise Invalid(where, "is a pytree leaf with a context or children")
        return
    if kind in ("builtins.tuple", "builtins.list"):
        if context != "null":
            raise Invalid(f"{where}.context", f"must be 'null' for a {kind}")
    elif kind == "builtins.dict":
        keys = None
        if isinstance(context, str) and len(context) <= MAX_CONTEXT:
            try:
                keys = parse_json(context)
            except Invalid:
                keys = None
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise Invalid(f"{where}.context", "must be a JSON list of string keys for a dict")
    else:
        raise Invalid(f"{where}.type", f"= {kind!r} is not tuple, list or dict")
    list_of(anything, max_len=1 << 16)(children, f"{where}.children_spec")
    for i, child in enumerate(children):
        _treespec_node(child, f"{where}.children_spec[{i}]", depth + 1)


def _treespec(value: Any, where: str) -> None:
    string(max_len=1 << 22)(value, where)
    doc = _embedded(value, where)
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] == 1 and type(doc[0]) is int):
        raise Invalid(where, "is not a pytree spec of protocol 1")
    _treespec_node(doc[1], f"{where}(spec)", 0)


_SIGNATURE = obj(
    {
        "inputs": list_of(ARGUMENT, 0),
        "outputs": list_of(ARGUMENT, 0),
        "in_spec": _treespec,
        "out_spec": _treespec,
    },
    {"forward_arg_names": nullable(list_of(_NAME))},
)

# ---- the whole program ------------------------------------------------------------------------


def _no_guards(value: Any, where: str) -> None:
    if value != []:
        raise Invalid(where, "holds guard code, which ep.module() would compile and run")


_USER_ARG = obj({"arg": union({"as_tensor": _TENSOR})})
MODEL: Spec = obj(
    {
        "graph_module": obj(
            {
                "graph": _GRAPH,
                "signature": obj(
                    {
                        "input_specs": list_of(union({"user_input": _USER_ARG})),
                        "output_specs": list_of(union({"user_output": _USER_ARG})),
                    }
                ),
                "module_call_graph": list_of(
                    obj({"fqn": one_of("")}, {"signature": nullable(_SIGNATURE)}), 1
                ),
            },
            {
                "metadata": dict_of(string(), max_len=0),
                "treespec_namedtuple_fields": dict_of(obj({}), max_len=0),
            },
        ),
        "opset_version": dict_of(integer(0, 1 << 20), key=_NAME, max_len=8),
        "range_constraints": dict_of(
            obj({"min_val": nullable(_I64), "max_val": nullable(_I64)}),
            key=string(SYMBOL_NAME),
        ),
        "schema_version": obj({"major": integer(0, 1 << 20), "minor": integer(0, 1 << 20)}),
    },
    {
        "verifiers": list_of(one_of("ATEN"), 1),
        "torch_version": string(re.compile(r"[0-9A-Za-z.+<=_-]{1,64}")),
        "guards_code": _no_guards,
    },
)


def check_model(doc: Any, namespaces: Sequence[str] = NAMESPACES) -> None:
    """Raise ``Invalid`` unless ``doc`` (a parsed model.json) is a stage graph of the shape
    above, calling ops of ``namespaces`` only. Nothing in it is evaluated, resolved or
    imported."""
    MODEL(doc, "")
    for i, node in enumerate(doc["graph_module"]["graph"]["nodes"]):
        if not allowed(node["target"], namespaces):
            raise Invalid(
                f"graph_module.graph.nodes[{i}].target",
                f"means a node calls {node['target'][:80]!r}, an op of none of the namespaces "
                f"this load trusts ({', '.join(namespaces)})",
            )
