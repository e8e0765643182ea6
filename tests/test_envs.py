"""The tool environments: the restricted evaluator (what it computes, what it refuses, its time
limit), the calculator and Python tool conversations token ids in and out, and loading by name.
(tests/faults/test_code_tool.py: what the Python tool's sandbox contains.)"""
import time

import pytest

from isolation.sandbox import CodeSandbox
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.envs import Calculator, EnvError, PythonTool, environment_factory
from jaxrl.envs.expression import FUNCTIONS, EvalError, run_expression
from jaxrl.rewards.math import math_equal

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def sandbox():
  """The Python tool's sandbox (a run starts one of its own: train/task/processes.py)."""
  with_servers = CodeSandbox(workers=1)
  yield with_servers
  with_servers.close()


@pytest.mark.parametrize("expression,value", [
    ("12*7+3", 87), ("(1234 + 5678) * 3", 20736), ("7/2", 3.5), ("7//2", 3), ("-2**3", -8),
    ("2**10 % 1000", 24), ("-(3 - 5) * 2.5", 5.0),
])
def test_arithmetic(expression, value):
  assert run_expression(expression) == value


@pytest.mark.parametrize("expression", ["1 < 2", "3 if 1 > 2 else 4", "[1, 2]", "'ab' * 2",
                                        "(1, 2)[0]", "not 1", "True + 1", "[x for x in []]"])
def test_the_calculator_takes_arithmetic_only(expression):
  assert Calculator(TOK, math_equal).run(expression).startswith("error: ")


@pytest.mark.parametrize("expression", [
    "[[[0] * 10000] * 10000] * 10000 == [[[0] * 10000] * 10000] * 10000",  # shared references
    "['9' * 10000] * 10000", "[['9' * 10000] * 10000] * 10000", "[[0] * 10000] * 2",
    "[sorted(range(9999)) for i in range(10000)]", "[[0] * 5000 for i in range(10000)]",
    "[range(10000)] * 10000", "[[0] * 9000] + [[0] * 9000]",
])
def test_large_values_are_refused_within_the_limit(expression):
  """Sizes count the whole value: each of these answers within a 1 s limit."""
  t0 = time.monotonic()
  with pytest.raises(EvalError, match="sequence too long"):
    run_expression(expression, functions=FUNCTIONS, time_limit_s=1.0)
  assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("limit", [None, 300])
def test_a_long_output_is_cut_before_it_is_encoded(sandbox, limit):
  """At 2000 characters, or at `max_output_chars` (rl.environment.max_output_chars)."""
  env = PythonTool(TOK, math_equal, sandbox=sandbox,
                   **({} if limit is None else {"max_output_chars": limit}))
  env.reset(Example("?", "0"))
  reply = TOK.decode(env.step(TOK.encode("<python>print('9' * 5000)</python>")).observation)
  cut = limit or 2000
  assert reply == f" <output>{'9' * cut} ... [{5001 - cut} more characters cut]</output>"


def test_python_expressions_with_the_whitelist():
  assert run_expression("sum(i * i for i in range(10))", functions=FUNCTIONS) == 285
  assert run_expression("sorted([3, 1, 2])[::-1]", functions=FUNCTIONS) == [3, 2, 1]
  assert run_expression("max(gcd(12, 18), round(sqrt(2), 3))", functions=FUNCTIONS) == 6
  assert run_expression("[x for x in range(6) if x % 2]", functions=FUNCTIONS) == [1, 3, 5]


@pytest.mark.parametrize("expression,reason", [
    ("__import__('os')", "name '__import__' is not defined"),
    ("open('/etc/passwd').read()", "Attribute is not allowed"),
    ("(1).__class__", "Attribute is not allowed"),
    ("(lambda: 1)()", "Lambda is not allowed"),
    ("sum", "Name is not allowed (arithmetic only)"),  # without the whitelist
    ("x = 1", "syntax error"),
    ("9 ** 9 ** 9", "number too large"),
    ("'x' * 10 ** 9", "sequence too long"),
    ("factorial(100000)", "number too large"),
    ("1 / 0", "ZeroDivisionError"),
    ("[1, 2][5]", "IndexError"),
    # whatever the model writes comes back as an EvalError, never an exception that ends the run
    ("[1, 2][::0]", "ValueError"), ("[x for x in 5]", "TypeError"),
    ("range(10 ** 19)", "OverflowError"), ("+".join(["1"] * 600), "RecursionError"),
    ("round(1, -10 ** 9)", "number too large"), ("'%0999999999d' % 0", "string formatting"),
    ("sum([[0] * 10] * 10)", "sum takes numbers"), ("1" * 3000, "expression too long"),
])
def test_what_the_evaluator_refuses(expression, reason):
  with pytest.raises(EvalError, match=reason.replace("(", r"\(").replace(")", r"\)")):
    run_expression(expression, functions=FUNCTIONS if "sum" != expression else None)


def test_time_limit():
  t0 = time.monotonic()
  with pytest.raises(EvalError, match="time limit exceeded"):
    run_expression("[sum([j for j in range(9000)]) for i in range(9000)]", functions=FUNCTIONS,
             time_limit_s=0.2)
  assert time.monotonic() - t0 < 2.0


def test_calculator_conversation_is_token_ids_in_and_out():
  env = Calculator(TOK, math_equal)
  assert env.stop_strings == ("</calc>",)
  assert env.reset(Example("What is 123*45?", "5535")) == []
  step = env.step(TOK.encode("123*45 = <calc>123*45</calc>"))
  assert step == type(step)(TOK.encode(" <result>5535</result>"), 0.0, False)
  step = env.step(TOK.encode(" so the answer is #### 5535"))
  assert step.done and step.reward == 1.0 and step.observation == []
  env.reset(Example("What is 2/0?", "0"))
  assert TOK.decode(env.step(TOK.encode("<calc>2/0</calc>")).observation) == \
      " <result>error: ZeroDivisionError: division by zero</result>"
  wrong = env.step(TOK.encode("#### 7"))
  assert wrong.done and wrong.reward == 0.0


def test_python_tool_conversation(sandbox):
  env = PythonTool(TOK, math_equal, sandbox=sandbox)
  env.reset(Example("Sum of squares below 10?", "285"))
  program = "import math\ntotal = 0\nfor i in range(10):\n  total += i * i\nprint(total)"
  step = env.step(TOK.encode(f"<python>{program}</python>"))
  assert TOK.decode(step.observation) == " <output>285\n</output>" and not step.done
  step = env.step(TOK.encode("<python>print(1 / 0)</python>"))
  assert TOK.decode(step.observation) == (
      ' <output>Traceback (most recent call last):\n  File "<program>", line 1, in <module>\n'
      "ZeroDivisionError: division by zero\n</output>")
  assert env.step(TOK.encode("#### 285")).reward == 1.0


class Echo:
  """A user environment: replies with the model's turn once, then ends with reward 0.5."""

  def __init__(self, tok, verifier):
    self.stop_strings, self.turns = ("?",), 0

  def reset(self, example):
    self.turns = 0
    return [1, 2]

  def step(self, turn_ids):
    self.turns += 1
    from jaxrl.envs import Step
    return Step(list(turn_ids), 0.5, self.turns > 1)


def test_environments_load_by_name_or_from_a_module():
  assert environment_factory("calculator") is Calculator
  assert environment_factory("python") is PythonTool
  assert environment_factory("test_envs:Echo") is Echo
  for spec, message in [("chess", "environment 'chess': expected one of ['calculator', 'python', "
                                  "'synthetic', 'synthetic_longtail', "
                                  "'synthetic_short']"),
                        ("no_such_module_xyz:Env", "no module named 'no_such_module_xyz'"),
                        ("test_envs:Missing", "has no attribute 'Missing'"),
                        ("test_envs:TOK", "is a ByteTokenizer, not callable")]:
    with pytest.raises(EnvError, match=message.replace("[", r"\[").replace("]", r"\]")):
      environment_factory(spec)


def test_the_synthetic_workload_answers_every_turn_alike_for_eight_turns():
  env = environment_factory("synthetic")(ByteTokenizer(), None)
  assert env.reset(Example("q", "1")) == [] and env.stop_strings == ()
  steps = [env.step([65 + t, 66]) for t in range(8)]
  assert all(len(s.observation) == 100 and s.observation == steps[0].observation for s in steps)
  assert [s.done for s in steps] == [False] * 7 + [True]
  assert all(s.reward == 0 for s in steps[:7]) and 0 <= steps[-1].reward <= 1
  short = environment_factory("synthetic_short")(ByteTokenizer(), None)
  assert [len(s.observation) for s in map(short.step, [[65]] * 3)] == [4] * 3 and short.turns == 3
  tail = environment_factory("synthetic_longtail")(ByteTokenizer(), None)
  assert [tail.step([65, 66]).done for _ in range(3)] == [False] * 3  # 131: goes on
  assert tail.step([64]).done and tail.turns == 4  # 64: a multiple of 4 ends it
