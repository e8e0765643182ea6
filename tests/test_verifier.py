import pytest

from jaxrl.rewards.verifier import exact_match, extract_answer


@pytest.mark.parametrize("response,answer,expected", [
    ("46", "46", 1.0),
    (" 46 ", "46", 1.0),
    ("046", "46", 1.0),
    ("45", "46", 0.0),
    ("", "46", 0.0),
    ("4 6", "46", 0.0),
    ("The answer is 46.", "46", 1.0),
    ("work...\n#### 1,234", "1234", 1.0),
    ("Answer: cba", "cba", 1.0),
    ("cba\nextra lines", "cba", 1.0),
    ("abc", "cba", 0.0),
    ("-7", "-7", 1.0),
])
def test_exact_match(response, answer, expected):
  assert exact_match(response, answer) == expected


def test_extract_answer_uses_last_marker():
  assert extract_answer("answer: 1 ... final answer: 2") == "2"
