import pytest

from jaxrl.rewards.verifier import char_match, exact_match, extract_answer


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


@pytest.mark.parametrize("response,answer,expected", [
    ("edcba", "edcba", 1.0),
    ("edcab", "edcba", 3 / 5),  # the last two swapped
    ("edc", "edcba", 3 / 5),  # missing letters are misses
    ("edcbaxx", "edcba", 5 / 7),  # and so are extra ones
    ("", "edcba", 0.0),
    ("answer: ab", "ab", 1.0),  # the same extraction as exact_match
])
def test_char_match_gives_the_share_of_letters_in_place(response, answer, expected):
  assert char_match(response, answer) == pytest.approx(expected)
  assert (char_match(response, answer) == 1.0) == (exact_match(response, answer) == 1.0)
