"""A restricted evaluator of Python expressions: the calculator's (arithmetic only), and with
`FUNCTIONS` a whitelist a user's tool environment may offer.

Why not the code tool's sandbox (isolation/sandbox.py): a calculator call happens per turn per row,
thousands per RL step, and costs microseconds here where a sandboxed program costs
milliseconds. Here nothing outside a small whitelist can run: the expression is parsed with
`ast` and walked node by node; there are no attribute lookups, imports, assignments, lambdas or
loops (only comprehensions over bounded `range`s), names resolve only to the whitelisted
functions, and no file, network or interpreter state is reachable. Work is bounded: every node checks a deadline
(`time_limit_s`), integers stay below `MAX_DIGITS` digits (a power is refused before it is
computed), and every value below `MAX_ITEMS` items counted over the whole of it (nested
lists and strings included, a reference shared n times counted n times: `[[0] * 10**4] * 10**4`
is refused as it is built, before anything compares or renders it). Any violation is an
`EvalError` with a short reason, which the environment returns to the model as the tool's
output. Without `functions` only arithmetic runs: numbers, + - * / // % **, signs, parentheses.
"""
from __future__ import annotations

import ast
import math
import operator
import time

MAX_DIGITS = 300
MAX_ITEMS = 10_000

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
            ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
FUNCTIONS = {"abs": abs, "min": min, "max": max, "round": lambda x, n=None: round(x, _digits(n)),
             "sum": lambda items: sum(_numbers(items)), "len": len,
             "int": int, "float": float, "sorted": sorted, "range": range, "sqrt": math.sqrt,
             "floor": math.floor, "ceil": math.ceil, "gcd": math.gcd, "log": math.log,
             "exp": math.exp, "factorial": lambda n: math.factorial(_small(n)), "pi": math.pi,
             "e": math.e}


def _digits(n):
  if isinstance(n, int) and abs(n) > 100:  # round(1, -10**9) would build 10**(10**9)
    raise EvalError("number too large")
  return n


def _numbers(items):
  items = list(items)
  if not all(isinstance(x, (int, float)) for x in items):  # summing lists is quadratic
    raise EvalError("sum takes numbers")
  return items


def _small(n):
  """An argument whose result would be too large to compute in time is refused up front."""
  if isinstance(n, int) and n > 150:
    raise EvalError("number too large")
  return n


class EvalError(ValueError):
  """The expression cannot be evaluated here; the message is what the model gets back."""


_ARITHMETIC = ("Expression", "Constant", "BinOp", "UnaryOp")


class _Walker:

  def __init__(self, functions: dict, deadline: float):
    self.functions, self.deadline, self.scopes = functions, deadline, [{}]
    self.arithmetic = not functions  # numbers and operators only

  def __call__(self, node):
    if time.monotonic() > self.deadline:
      raise EvalError("time limit exceeded")
    kind = type(node).__name__
    method = getattr(self, "_" + kind, None)
    if method is None or (self.arithmetic and kind not in _ARITHMETIC):
      raise EvalError(f"{kind} is not allowed" + (" (arithmetic only)" if method else ""))
    return _checked(method(node))

  def _Expression(self, node):
    return self(node.body)

  def _Constant(self, node):
    allowed = (int, float) if self.arithmetic else (int, float, bool, str)
    if not isinstance(node.value, allowed) or (self.arithmetic and isinstance(node.value, bool)):
      raise EvalError(f"constant {node.value!r} is not allowed")
    return node.value

  def _Name(self, node):
    for scope in reversed(self.scopes):
      if node.id in scope:
        return scope[node.id]
    if node.id in self.functions:
      return self.functions[node.id]
    raise EvalError(f"name {node.id!r} is not defined")

  def _BinOp(self, node):
    left, right = self(node.left), self(node.right)
    if type(node.op) not in _BINARY:
      raise EvalError(f"operator {type(node.op).__name__} is not allowed")
    if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int):
      if right > 0 and abs(left) > 1 and right * math.log10(abs(left)) > MAX_DIGITS:
        raise EvalError("number too large")
    if isinstance(node.op, ast.Mod) and isinstance(left, str):
      raise EvalError("string formatting is not allowed")  # "%0999999999d" % 0
    if isinstance(node.op, ast.Mult):  # refused before "x" * 10**9 is built
      seq, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
      if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and (
          count * len(seq) > MAX_ITEMS):
        raise EvalError("sequence too long")
    try:
      return _BINARY[type(node.op)](left, right)
    except (ArithmeticError, TypeError, ValueError) as e:
      raise EvalError(f"{type(e).__name__}: {e}") from None

  def _UnaryOp(self, node):
    if type(node.op) not in _UNARY or (self.arithmetic and isinstance(node.op, ast.Not)):
      raise EvalError(f"operator {type(node.op).__name__} is not allowed")
    try:
      return _UNARY[type(node.op)](self(node.operand))
    except TypeError as e:
      raise EvalError(f"TypeError: {e}") from None

  def _BoolOp(self, node):
    value = self(node.values[0])
    for item in node.values[1:]:
      if isinstance(node.op, ast.And) != bool(value):
        return value
      value = self(item)
    return value

  def _Compare(self, node):
    left = self(node.left)
    for op, right_node in zip(node.ops, node.comparators):
      right = self(right_node)
      if type(op) not in _COMPARE:
        raise EvalError(f"comparison {type(op).__name__} is not allowed")
      try:
        if not _COMPARE[type(op)](left, right):
          return False
      except TypeError as e:
        raise EvalError(f"TypeError: {e}") from None
      left = right
    return True

  def _IfExp(self, node):
    return self(node.body) if self(node.test) else self(node.orelse)

  def _List(self, node):
    return [self(x) for x in node.elts]

  def _Tuple(self, node):
    return tuple(self(x) for x in node.elts)

  def _Subscript(self, node):
    value, index = self(node.value), self(node.slice)
    try:
      return value[index]
    except (IndexError, KeyError, TypeError) as e:
      raise EvalError(f"{type(e).__name__}: {e}") from None

  def _Slice(self, node):
    part = lambda x: None if x is None else self(x)
    return slice(part(node.lower), part(node.upper), part(node.step))

  def _Call(self, node):
    fn = self(node.func)
    if node.keywords or not any(fn is f for f in self.functions.values()):
      raise EvalError("only calls of the allowed functions, without keywords")
    args = [self(a) for a in node.args]
    try:
      return fn(*args)
    except EvalError:
      raise
    except (ArithmeticError, TypeError, ValueError) as e:
      raise EvalError(f"{type(e).__name__}: {e}") from None

  def _ListComp(self, node):
    if len(node.generators) != 1 or node.generators[0].is_async:
      raise EvalError("one 'for' per comprehension")
    gen = node.generators[0]
    if not isinstance(gen.target, ast.Name):
      raise EvalError("comprehension targets are plain names")
    out, size = [], 0
    for item in self(gen.iter):
      self.scopes.append({gen.target.id: item})
      try:
        if all(self(cond) for cond in gen.ifs):
          out.append(self(node.elt))
          size += _size(out[-1:], MAX_ITEMS)  # the item and what it holds
          if size > MAX_ITEMS:  # refused as it grows, not once it is built
            raise EvalError("sequence too long")
      finally:
        self.scopes.pop()
    return out

  _GeneratorExp = _ListComp


def _size(value, budget: int) -> int:
  """Items in `value` counted over all of it (a string's characters, a nested list's items and
  theirs; shared references each time), stopping once over `budget`: at most `budget` steps."""
  if isinstance(value, (str, range)):
    return len(value)
  if not isinstance(value, (list, tuple)):
    return 1
  total = len(value)
  for item in value:
    if total > budget:
      break
    if isinstance(item, (str, list, tuple, range)):
      total += _size(item, budget - total)
  return total


def _checked(value):
  if isinstance(value, int) and value.bit_length() > 3.33 * MAX_DIGITS:
    raise EvalError("number too large")
  if isinstance(value, (str, list, tuple, range)) and _size(value, MAX_ITEMS) > MAX_ITEMS:
    raise EvalError("sequence too long")
  return value


def run_expression(expression: str, *, functions: dict | None = None, time_limit_s: float = 1.0):
  """The value of `expression` under the whitelist (`functions`: the names it may call; none:
  arithmetic only)."""
  if len(expression) > 2000:
    raise EvalError("expression too long")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise EvalError(f"syntax error: {e.msg}") from None
  except (ValueError, RecursionError, MemoryError) as e:  # a NUL byte, deep nesting
    raise EvalError(f"cannot parse ({type(e).__name__})") from None
  try:
    return _Walker(functions or {}, time.monotonic() + time_limit_s)(tree)
  except EvalError:
    raise
  except Exception as e:  # whatever the model wrote, the run goes on: the model reads the error
    raise EvalError(f"{type(e).__name__}: {str(e)[:80]}") from None
