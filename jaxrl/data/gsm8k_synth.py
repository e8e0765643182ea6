"""Procedural grade-school word problems in GSM8K's row format, generated from a seed.

Each row is `{"question": str, "answer": str}`; the answer is a one- or two-sentence worked
solution whose every step reads `a+b = <<a+b=c>>c` (GSM8K's calculator annotation) and whose last
line is `#### N`. Invariants: rows are a pure function of (n, seed, difficulty, annotate); questions
are unique within a call; `generate(n, seed)[:k] == generate(k, seed)` because each row consumes the
random stream the same way whatever `n` is; `split` returns train and held-out sets disjoint by
question; every result (intermediate ones included) is a non-negative integer.

    python -m jaxrl.data.gsm8k_synth --out /tmp/gsm8k_synth --n_train 4000 --n_heldout 500 --seed 0
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Difficulty:
  max_operand: int = 20  # addends, minuends and the larger factor are drawn from 1..max_operand
  max_factor: int = 9  # the smaller factor of each product is drawn from 2..max_factor
  two_step: float = 0.5  # fraction of problems that need two calculations
  big_numbers: float = 0.0  # fraction of one-step sums/differences scaled by 100 (e.g. "1,200")

  def __post_init__(self):
    if self.max_operand < 2 or self.max_factor < 2:
      raise ValueError(f"difficulty: max_operand and max_factor must be >= 2, got {self}")
    if not (0.0 <= self.two_step <= 1.0 and 0.0 <= self.big_numbers <= 1.0):
      raise ValueError(f"difficulty: two_step and big_numbers must lie in [0, 1], got {self}")


DIFFICULTIES = {
    "easy": Difficulty(max_operand=10, max_factor=5, two_step=0.2),
    "medium": Difficulty(),
    "hard": Difficulty(max_operand=50, max_factor=12, two_step=0.7, big_numbers=0.05),
}

NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Eva", "Ben", "Zoe", "Max", "Lily", "Jack", "Emma",
         "Noah", "Ava", "Liam", "Ella", "Omar", "Nina", "Ravi", "Kate")
OBJECTS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards",
           "eggs", "flowers", "toys", "coins", "balloons", "candies", "crayons", "buttons", "beads",
           "stamps", "cupcakes", "oranges")

# kind -> (question, solution) pairs. {c1}/{c2} are the rendered calculations, in order; the
# sampler for each kind (below) decides which quantities they combine.
TEMPLATES: dict[str, tuple[tuple[str, str], ...]] = {
    "add": (
        ("{name} has {a} {obj}. {friend} gives {name} {b} more. How many {obj} does {name} have "
         "now?", "{name} has {c1} {obj} now."),
        ("{name} picked {a} {obj} in the morning and {b} in the afternoon. How many {obj} did "
         "{name} pick?", "{name} picked {c1} {obj}."),
    ),
    "sub": (
        ("{name} had {a} {obj} and gave {b} to {friend}. How many {obj} does {name} have left?",
         "{name} has {c1} {obj} left."),
        ("There are {a} {obj} in a box. {name} takes {b} of them. How many {obj} are left in the "
         "box?", "There are {c1} {obj} left in the box."),
    ),
    "mul": (
        ("{name} buys {a} bags of {obj}. Each bag has {b} {obj}. How many {obj} does {name} buy?",
         "{name} buys {c1} {obj}."),
        ("{name} earns {b} dollars each day. How many dollars does {name} earn in {a} days?",
         "{name} earns {c1} dollars."),
    ),
    "add_sub": (
        ("{name} has {a} {obj}, buys {b} more and gives {c} to {friend}. How many {obj} are left?",
         "{name} has {c1} {obj}, then {c2} {obj} left."),
    ),
    "add_add": (
        ("{name} reads {a} pages on Monday, {b} on Tuesday and {c} on Friday. How many pages is "
         "that?", "{name} reads {c1} pages, then {c2} pages in all."),
    ),
    "mul_add": (
        ("{name} has {a} boxes of {b} {obj} and {c} more. How many {obj} is that?",
         "{name} has {c1} in boxes and {c2} {obj} in all."),
    ),
    "mul_sub": (
        ("{name} buys {a} packs of {b} {obj} and loses {c}. How many {obj} are left?",
         "{name} buys {c1} {obj}, so {c2} are left."),
    ),
    "add_mul": (
        ("{name} buys {a} red and {b} blue bags with {c} {obj} in each. How many {obj} is that?",
         "{name} buys {c1} bags, so {c2} {obj}."),
    ),
}
ONE_STEP = ("add", "sub", "mul")
TWO_STEP = ("add_sub", "add_add", "mul_add", "mul_sub", "add_mul")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}

# A step is (left, op, right, result): names of quantities; "s" is the intermediate result, "r"
# the final one.
Step = tuple[str, str, str, str]


def _draw(rng: np.random.Generator, lo: int, hi: int) -> int:
  return int(rng.integers(lo, hi + 1))


def _sample(kind: str, rng: np.random.Generator,
            d: Difficulty) -> tuple[dict[str, int], list[Step]]:
  """The question's quantities and the steps that solve it; results stay non-negative."""
  hi, f = d.max_operand, d.max_factor
  if kind == "add":
    return {"a": _draw(rng, 1, hi), "b": _draw(rng, 1, hi)}, [("a", "+", "b", "r")]
  if kind == "sub":
    a = _draw(rng, 2, hi)
    return {"a": a, "b": _draw(rng, 1, a - 1)}, [("a", "-", "b", "r")]
  if kind == "mul":
    return {"a": _draw(rng, 2, f), "b": _draw(rng, 2, hi)}, [("a", "*", "b", "r")]
  if kind == "add_sub":
    a, b = _draw(rng, 1, hi), _draw(rng, 1, hi)
    q = {"a": a, "b": b, "c": _draw(rng, 1, a + b - 1)}
    return q, [("a", "+", "b", "s"), ("s", "-", "c", "r")]
  if kind == "add_add":
    q = {k: _draw(rng, 1, hi) for k in "abc"}
    return q, [("a", "+", "b", "s"), ("s", "+", "c", "r")]
  if kind == "mul_add":
    q = {"a": _draw(rng, 2, f), "b": _draw(rng, 2, hi), "c": _draw(rng, 1, hi)}
    return q, [("a", "*", "b", "s"), ("s", "+", "c", "r")]
  if kind == "mul_sub":
    a, b = _draw(rng, 2, f), _draw(rng, 2, hi)
    q = {"a": a, "b": b, "c": _draw(rng, 1, a * b - 1)}
    return q, [("a", "*", "b", "s"), ("s", "-", "c", "r")]
  if kind == "add_mul":
    # Addends bounded by max_factor so the product stays within the one-step products' range.
    q = {"a": _draw(rng, 1, f), "b": _draw(rng, 1, f), "c": _draw(rng, 2, f)}
    return q, [("a", "+", "b", "s"), ("s", "*", "c", "r")]
  raise ValueError(f"unknown problem kind {kind!r}; expected one of {sorted(TEMPLATES)}")


def _render_steps(values: dict[str, int], steps: list[Step], annotate: bool) -> list[str]:
  """Fills in `values["s"]`/`values["r"]` and renders each step GSM8K-style."""
  out = []
  for left, op, right, res in steps:
    x, y = values[left], values[right]
    values[res] = z = _OPS[op](x, y)
    calc = f"<<{x}{op}{y}={z}>>{z}" if annotate else f"{z}"
    out.append(f"{x:,}{op}{y:,} = {calc}")
  return out


def make_row(rng: np.random.Generator, d: Difficulty, annotate: bool = True) -> dict[str, str]:
  """One problem, drawn from `rng` alone, so a call's rows do not depend on how many it makes."""
  two_step, big, u_kind, u_tmpl = rng.random(4)
  pick = rng.choice(len(NAMES), size=2, replace=False)
  obj = OBJECTS[int(rng.integers(len(OBJECTS)))]
  kinds = TWO_STEP if two_step < d.two_step else ONE_STEP
  kind = kinds[int(u_kind * len(kinds))]
  question, solution = TEMPLATES[kind][int(u_tmpl * len(TEMPLATES[kind]))]
  values, steps = _sample(kind, rng, d)
  if kind in ("add", "sub") and big < d.big_numbers:
    values = {k: 100 * v for k, v in values.items()}
  calcs = _render_steps(values, steps, annotate)
  words = {"name": NAMES[pick[0]], "friend": NAMES[pick[1]], "obj": obj}
  words |= {k: f"{values[k]:,}" for k in "abc" if k in values}
  words |= {f"c{i + 1}": c for i, c in enumerate(calcs)}
  answer = f"{solution.format(**words)}\n#### {values['r']}"
  return {"question": question.format(**words), "answer": answer}


def generate(n: int, seed: int, difficulty: str | Difficulty = "medium",
             annotate: bool = True) -> list[dict[str, str]]:
  """`n` rows with distinct questions; raises if the difficulty cannot supply that many."""
  if isinstance(difficulty, str) and difficulty not in DIFFICULTIES:
    raise ValueError(f"difficulty: expected one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
  d = DIFFICULTIES[difficulty] if isinstance(difficulty, str) else difficulty
  rng = np.random.default_rng(seed)
  rows: dict[str, dict[str, str]] = {}
  tries = 0
  while len(rows) < n:
    row = make_row(rng, d, annotate)
    rows.setdefault(row["question"], row)
    tries += 1
    if tries > 20 * n + 1000:
      raise ValueError(f"difficulty {d} has fewer than {n} distinct questions; lower n")
  return list(rows.values())


_FIRST_STEP = re.compile(r"<<[^=>]+=(\d+)>>\1")


def teacher_slip(answer: str) -> str | None:
  """The worked solution an imperfect teacher writes for a two-step problem: it stops after the
  first step and answers its intermediate result (None for one-step solutions)."""
  steps = list(_FIRST_STEP.finditer(answer))
  if len(steps) < 2:
    return None
  first = steps[0]
  return f"{answer[:first.end()]}.\n#### {first.group(1)}"


_CALC = re.compile(r"<<([^=>]+)=(\d+)>>\2")


TOOL_FORMS = {"calculator": r"<calc>\1</calc> <result>\2</result>",
              "python": "<python>print(\\1)</python> <output>\\2\n</output>"}


def tool_calls(answer: str, tool: str = "calculator") -> str:
  """`answer` with each `<<a*b=c>>c` annotation written as a call of `tool` and its reply:
  `<calc>a*b</calc> <result>c</result>`, or the program `<python>print(a*b)</python>` and its
  output ` <output>c\n</output>`: the form a model with that environment (jaxrl/envs) writes,
  the result coming from the tool instead of the model's arithmetic."""
  return _CALC.sub(TOOL_FORMS[tool], answer)


def with_teacher_demos(rows: Sequence[dict[str, str]], fraction: float,
                       seed: int) -> list[dict[str, str]]:
  """`rows`, each with a `demo` field: the worked solution an imperfect teacher demonstrates.
  For a seeded `fraction` of the two-step problems it is a `teacher_slip`, otherwise the
  solution itself. SFT on `demo` copies the slips; `answer` (the reference a verifier checks)
  stays correct, so a verifier's reward can train them away."""
  rng = np.random.default_rng(seed)
  out = []
  for row in rows:
    slip = teacher_slip(row["answer"])
    demo = slip if slip is not None and rng.random() < fraction else row["answer"]
    out.append({**row, "demo": demo})
  return out


def split(rows: Sequence[dict[str, str]], n_heldout: int,
          seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
  """(train, heldout): a seeded shuffle; train drops any row whose question is held out."""
  if not 0 <= n_heldout <= len(rows):
    raise ValueError(f"n_heldout must lie in [0, {len(rows)}], got {n_heldout}")
  order = np.random.default_rng(seed).permutation(len(rows))
  heldout = [rows[i] for i in order[:n_heldout]]
  held_questions = {r["question"] for r in heldout}
  train = [rows[i] for i in order[n_heldout:] if rows[i]["question"] not in held_questions]
  return train, heldout


def final_answer(answer: str) -> str:
  """The text after GSM8K's `####` marker."""
  return answer.rsplit("####", 1)[1].strip()


def write_jsonl(rows: Sequence[dict], path: str | os.PathLike) -> None:
  """Writes `path.tmp` then renames it, so a reader never sees a half-written file."""
  tmp = f"{os.fspath(path)}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
  parser.add_argument("--n_train", type=int, default=4000)
  parser.add_argument("--n_heldout", type=int, default=500)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--difficulty", choices=sorted(DIFFICULTIES), default="medium")
  parser.add_argument("--no_annotate", action="store_true", help="drop the <<a+b=c>> annotations")
  args = parser.parse_args(argv)
  rows = generate(args.n_train + args.n_heldout, args.seed, args.difficulty,
                  annotate=not args.no_annotate)
  train, test = split(rows, args.n_heldout, args.seed)
  os.makedirs(args.out, exist_ok=True)
  write_jsonl(train, os.path.join(args.out, "train.jsonl"))
  write_jsonl(test, os.path.join(args.out, "test.jsonl"))
  print(f"wrote {len(train)} train and {len(test)} test rows to {args.out}")


if __name__ == "__main__":
  main()
