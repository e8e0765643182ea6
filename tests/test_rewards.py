import threading
import time

import numpy as np
import pytest

from jaxrl.rewards import VERIFIERS, RewardFnError, call_reward_fn, load_reward_fn, math_equal

EQUAL = [
    ("1,000", "1000"), ("The total is $5.", "5"), ("She pays 5 dollars.", "5"), ("5 apples", "5"),
    ("0.5", r"\frac{1}{2}"), (r"so $\frac{1}{2}$", "0.5"), ("50%", "50"), ("50%", "0.5"),
    (r"Thus \boxed{\frac{1}{2}}.", "1/2"), ("The answer is 42. I checked 41 too.", "42"),
    ("48 + 24 = 72\n#### 72", "72"), ("work... #### 1,234\n", "1234"), ("#### -7", "-7"),
    (r"The final answer is $\boxed{\sqrt{2}}$", r"\sqrt{2}"), ("I get 3 then 7", "7"),
    (r"$x = 3$", "3"), ("1234", "1,234"), (r"\boxed{3\sqrt{2}}", r"\sqrt{18}"),
    (r"\boxed{(1,2)}", "(1, 2)"), (r"\boxed{\text{(A)}}", "A"), (r"\boxed{2x+1}", "1+2x"), (r"\boxed{(x+1)^{500}}", "(x+1)^{500}"),
    (r"$12 \times 5 = 60$", "60"), ("the answer is 48 + 24 = 72", "72"),  # worked, then stated
]
NOT_EQUAL = [
    ("41", "42"), ("1/2", "1/3"), (r"\boxed{\frac{1}{2}}", "0.51"), ("#### 72\nor maybe 5", "5"),
    ("no number here", "3"), ("", "3"), ("42", "cba"), (r"\boxed{2x+1}", "2x-1"),
    ("12", "1,234"), (r"\boxed{(1,2)}", "(2,1)"), ("The answer is 42.", "4"),
    # Bounded instead of timed out: these would make sympy run for minutes.
    (r"\boxed{10^{10^{10^{10}}}}", "5"), ("2**2**2**2**2**2", "3"), (r"\boxed{(x+y+z)^{1000}}", "5"),
    # Arithmetic left undone is no answer to an integer question (a policy learned to score so).
    ("Nina has 967+589 = <calc>967+589</calc> <result>1117", "1556"), ("#### 2*3", "6"),
    (r"\boxed{3+4}", "7"), (r"967\,+\,589", "1556"), ("(967)+(589)", "1556"),
]


@pytest.mark.parametrize("response,answer", EQUAL)
def test_math_equal(response, answer):
  assert math_equal(response, answer) == 1.0


@pytest.mark.parametrize("response,answer", NOT_EQUAL)
def test_math_not_equal(response, answer):
  assert math_equal(response, answer) == 0.0


def test_math_is_registered_and_exact_match_kept():
  assert VERIFIERS["math"] is math_equal
  assert VERIFIERS["exact_match"]("#### 1,234", "1234") == 1.0


def test_math_equal_runs_in_threads_deterministically():
  cases = EQUAL[:6] + NOT_EQUAL[:4]
  want = [math_equal(r, a) for r, a in cases]
  got, errors = {}, []

  def work(k):
    try:
      got[k] = [math_equal(r, a) for r, a in cases]
    except Exception as e:  # a signal-based timeout raises ValueError outside the main thread
      errors.append(e)

  threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and all(v == want for v in got.values()) and len(got) == 3


def test_pathological_inputs_are_bounded():
  start = time.perf_counter()
  assert math_equal("1 " * 20000 + "#### 7", "7") == 1.0
  assert math_equal("1 " * 20000, "1") == 1.0  # only the tail is read
  assert time.perf_counter() - start < 30  # loose: the point is it ends, not how fast


REWARD_MODULE = '''
import numpy as np

def length(prompts, completions, **fields):
  return [float(len(c)) for c in completions]

def uses_fields(prompts, completions, answer, level, **kwargs):
  return np.array([float(c == a) + lv for c, a, lv in zip(completions, answer, level)])

def boom(prompts, completions, **kwargs):
  return [1.0 / (len(c) - 3) for c in completions]

def short(prompts, completions, **kwargs):
  return [1.0]

def not_number(prompts, completions, **kwargs):
  return [1.0, "high"]

def nan(prompts, completions, **kwargs):
  return [1.0, float("nan")]

def scalar(prompts, completions, **kwargs):
  return 1.0

class Scorer:
  @staticmethod
  def score(prompts, completions, **kwargs):
    return [0.5] * len(completions)

NOT_CALLABLE = 3
'''


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
  (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency_xyz\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  return "my_rewards"


def test_user_reward_fn(reward_module):
  fields = [{"answer": "ab", "level": 1}, {"answer": "x", "level": 2}]
  rewards = call_reward_fn(load_reward_fn(f"{reward_module}:length"), ["p", "q"], ["ab", "xyz"])
  assert rewards.dtype == np.float32 and rewards.tolist() == [2.0, 3.0]
  rewards = call_reward_fn(load_reward_fn(f"{reward_module}:uses_fields"), ["p", "q"],
                           ["ab", "xyz"], fields)
  assert rewards.tolist() == [2.0, 2.0]
  rewards = call_reward_fn(load_reward_fn(f"{reward_module}:Scorer.score"), ["p"], ["a"], [{}])
  assert rewards.tolist() == [0.5]


@pytest.mark.parametrize("spec,message", [
    ("my_rewards", r"'my_rewards': expected 'package.module:function'$"),
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f': no module named 'no_such_module_xyz'$"),
    ("my_rewards:missing", r"'my_rewards:missing': 'my_rewards' has no attribute 'missing'$"),
    ("my_rewards:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not callable$"),
    ("broken_rewards:f", r"importing 'broken_rewards' failed \(ModuleNotFoundError: No module "
                         r"named 'not_a_real_dependency_xyz'\)$"),
])
def test_load_reward_fn_errors(reward_module, spec, message):
  with pytest.raises(RewardFnError, match=message) as info:
    load_reward_fn(spec)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,message", [
    ("boom", r"my_rewards:boom on sample 1: raised ZeroDivisionError: float division by zero$"),
    ("short", r"my_rewards:short: returned 1 rewards for 2 samples$"),
    ("not_number", r"my_rewards:not_number on sample 1: returned 'high', not a finite number$"),
    ("nan", r"my_rewards:nan on sample 1: returned nan, not a finite number$"),
    ("scalar", r"my_rewards:scalar: returned a float, not a list of 2 numbers$"),
])
def test_call_reward_fn_errors(reward_module, name, message):
  fn = load_reward_fn(f"{reward_module}:{name}")
  with pytest.raises(RewardFnError, match=message) as info:
    call_reward_fn(fn, ["p", "q"], ["ab", "xyz"], [{}, {}])
  assert "\n" not in str(info.value)
