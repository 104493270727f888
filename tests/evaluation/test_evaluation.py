"""megarl.evaluation: pass@k (exact, brute force, Monte Carlo), curves, majority vote, perplexity, the plot."""
import itertools
import math
import random
from fractions import Fraction

import pytest

from megarl.evaluation import (
    majority_answer,
    majority_at_n,
    mean_at_n,
    mean_entropy,
    normalise_answer,
    pass_at_k,
    pass_at_k_curve,
    perplexity,
    plot_pass_at_k,
)

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4),
    (5, 2, 2, 0.7),    # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 4, 1.0),    # n - c = 3 < k: every 4-subset holds a correct sample
    (10, 0, 3, 0.0),
    (10, 10, 1, 1.0),
])
def test_pass_at_k_hand_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_pass_at_k_exact_edges():
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 0, 3) == 0.0 and pass_at_k(1, 0, 1) == 0.0 and pass_at_k(1, 1, 1) == 1.0


def _reference(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_comb_formula_for_all_small_cases():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert abs(pass_at_k(n, c, k) - float(_reference(n, c, k))) < 1e-12, (n, c, k)


def test_pass_at_k_large_n_is_finite_and_accurate():
    # C(1000, 500) overflows a float; the product form does not care.
    value = pass_at_k(1000, 3, 500)
    assert abs(value - float(_reference(1000, 3, 500))) < 1e-12
    tiny = pass_at_k(10_000, 1, 1)  # exactly 1e-4; expm1 keeps small values accurate
    assert tiny == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_bad_inputs(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_integers():
    with pytest.raises(TypeError):
        pass_at_k(5.0, 2, 1)
    with pytest.raises(TypeError):
        pass_at_k(5, True, 1)


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (6, 1, 3), (7, 3, 2), (8, 2, 5), (9, 4, 4), (6, 0, 2), (6, 5, 2)])
def test_pass_at_k_equals_brute_force_subset_count(n, c, k):
    correct = [i < c for i in range(n)]
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(correct[i] for i in subset) for subset in subsets)
    assert Fraction(hits, len(subsets)) == _reference(n, c, k)
    assert abs(pass_at_k(n, c, k) - hits / len(subsets)) < 1e-12


@pytest.mark.parametrize("n,c,k", [(16, 2, 4), (20, 5, 3), (12, 1, 6)])
def test_pass_at_k_agrees_with_monte_carlo(n, c, k):
    rng = random.Random(1234 + n * 100 + c * 10 + k)
    draws = 20_000
    hits = sum(any(i < c for i in rng.sample(range(n), k)) for _ in range(draws))
    p = pass_at_k(n, c, k)
    standard_error = math.sqrt(p * (1 - p) / draws)
    assert abs(hits / draws - p) <= 4 * standard_error


# ---------------------------------------------------------------- curve and mean@n


def _random_correct(prompts, n, seed):
    rng = random.Random(seed)
    return [[rng.random() < rng.random() for _ in range(n)] for _ in range(prompts)]


def test_curve_properties():
    correct = _random_correct(prompts=13, n=8, seed=0) + [[False] * 8, [True] * 8]
    curve = pass_at_k_curve(correct)
    assert sorted(curve) == list(range(1, 9))
    values = [curve[k] for k in range(1, 9)]
    assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))
    assert curve[1] == pytest.approx(mean_at_n(correct), abs=1e-12)
    assert curve[8] == pytest.approx(sum(any(s) for s in correct) / len(correct), abs=1e-15)


def test_curve_hand_case():
    curve = pass_at_k_curve([[True, False, False, False], [False, False, False, False]])
    # prompt 0: pass@k = k/4 (one correct of four); prompt 1: 0.
    assert curve == pytest.approx({1: 0.125, 2: 0.25, 3: 0.375, 4: 0.5}, abs=1e-15)


def test_curve_rejects_unequal_samples_naming_the_prompt():
    with pytest.raises(ValueError, match="prompt 2 has 3"):
        pass_at_k_curve([[True] * 4, [False] * 4, [True] * 3])
    with pytest.raises(ValueError):
        pass_at_k_curve([])
    with pytest.raises(ValueError):
        pass_at_k_curve([[]])


def test_mean_at_n():
    assert mean_at_n([[True, False], [True, True]]) == 0.75
    assert mean_at_n([[True], [False, False, False]]) == 0.25  # over samples, not prompts
    with pytest.raises(ValueError):
        mean_at_n([[], []])


# ---------------------------------------------------------------- majority vote


@pytest.mark.parametrize("text,expected", [
    ("  42. ", "42"), ("042", "42"), ("4.0", "4"), ("-0.50", "-0.5"), ("+3", "3"), ("-0", "0"), ("100", "100"),
    ("0.0", "0"), ("12345678901234567890123456789012345", "12345678901234567890123456789012345"),
    ("  The   Answer\tIs  Paris.", "the answer is paris"), ("", None), ("   ", None), (" . ", None), (None, None),
    ("3.14.", "3.14"), ("x = 042", "x = 042"),
])
def test_normalise_answer(text, expected):
    assert normalise_answer(text) == expected


def test_majority_answer():
    assert majority_answer(["7", "042", "42", "7.0", "42."]) == "42"
    assert majority_answer(["a", "b", "b", "a"]) == "a"              # tie: first to occur
    assert majority_answer(["b", "a", "a", "b"]) == "b"
    assert majority_answer([None, None, "5", None]) == "5"             # unparseable answers do not vote
    assert majority_answer([None, "", "  "]) is None


def test_majority_at_n_hand_cases():
    groups = [
        [("042", True), ("42", True), ("7", False)],                   # "42" wins 2-1, correct -> 1
        [("7", False), ("7", False), ("42", True)],                    # wrong majority -> 0
        [("b", False), ("a", True), ("a", True), ("b", False)],        # tie: "b" occurs first -> 0
        [(None, False), (None, False), ("5", True)],                   # None excluded: "5" wins -> 1
        [(None, False), ("", False)],                                  # nothing parses -> 0
    ]
    assert majority_at_n(groups) == pytest.approx(2 / 5)
    # The vote is on normalised answers, so "Paris." and "paris" pool together against "Rome" x2.
    assert majority_at_n([[("Paris.", True), ("Rome", False), ("paris", True), ("Rome", False), ("PARIS", True)]]) == 1


def test_majority_at_n_inconsistent_grader_scores_fraction():
    assert majority_at_n([[("x", True), ("x", False), ("y", True)]]) == 0.5


def test_majority_at_n_rejects_empty():
    with pytest.raises(ValueError):
        majority_at_n([])
    with pytest.raises(ValueError, match="prompt 1"):
        majority_at_n([[("1", True)], []])


# ---------------------------------------------------------------- perplexity and entropy


def test_perplexity_of_uniform_is_vocab_size():
    vocab = 50
    log_probs = [[math.log(1 / vocab)] * 7, [math.log(1 / vocab)] * 3]
    assert perplexity(log_probs) == pytest.approx(vocab, rel=1e-12)


def test_perplexity_and_entropy_are_token_weighted():
    log_probs = [[-1.0], [-2.0, -2.0, -2.0]]
    # token mean = (-1 - 6) / 4 = -1.75, not the per-response mean (-1 - 2) / 2 = -1.5
    assert perplexity(log_probs) == pytest.approx(math.exp(1.75), rel=1e-12)
    assert mean_entropy([[0.5], [1.5, 1.5, 1.5]]) == pytest.approx((0.5 + 4.5) / 4, rel=1e-12)
    assert perplexity([[0.0, 0.0]]) == 1.0


def test_perplexity_edges():
    assert perplexity([[-1000.0]]) == math.inf
    with pytest.raises(ValueError):
        perplexity([[], []])
    with pytest.raises(ValueError):
        mean_entropy([])


# ---------------------------------------------------------------- plot


@pytest.mark.parametrize("n", [4, 16])
def test_plot_pass_at_k_writes_png(tmp_path, n):
    before = pass_at_k_curve(_random_correct(prompts=5, n=n, seed=1))
    after = pass_at_k_curve(_random_correct(prompts=5, n=n, seed=2))
    path = str(tmp_path / "sub" / f"pass_at_k_{n}.png")
    assert plot_pass_at_k({"before": before, "after": after}, path, title="test") == path
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_pass_at_k_rejects_empty(tmp_path):
    with pytest.raises(ValueError):
        plot_pass_at_k({}, str(tmp_path / "x.png"))
