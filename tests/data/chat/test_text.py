"""String work on rendered chats (`sft.data.chat.text`): where two renderings part, token boundaries, stop tokens,
a tool definition's name."""

import os.path
import random

import pytest

from sft.data.chat.text import (common_prefix, divergence, first_stop, first_stop_with_space, stop_at, token_boundary,
                                tool_name)


def test_the_common_prefix_is_the_longest_one_on_any_texts():
    """The bisection against the standard library's character-by-character answer, on texts that share prefixes
    of every length (none, part, one inside the other, equal)."""
    rng = random.Random(0)
    for _ in range(500):
        shared = "".join(rng.choice("ab<|>") for _ in range(rng.randrange(0, 40)))
        a = shared + "".join(rng.choice("ab<|>") for _ in range(rng.randrange(0, 10)))
        b = shared + "".join(rng.choice("ab<|>") for _ in range(rng.randrange(0, 10)))
        assert common_prefix(a, b) == len(os.path.commonprefix([a, b])), (a, b)


def test_a_parting_inside_an_added_token_moves_back_to_its_start():
    """`<|START_THINKING|>` and `<|START_RESPONSE|>` share `<|START_`: the renderings part before the token, never
    inside it; a place between tokens stays."""
    a, b = "x<|START_THINKING|>y", "x<|START_RESPONSE|>y"
    tokens = ["<|START_THINKING|>", "<|START_RESPONSE|>"]
    assert common_prefix(a, b) == len("x<|START_")
    assert token_boundary(a, common_prefix(a, b), tokens) == 1
    assert token_boundary(a, 1, tokens) == 1 and token_boundary(a, len(a) - 1, tokens) == len(a) - 1
    assert divergence(a, b) == "'x<|START_THINKING|>y' vs 'x<|START_RESPONSE|>y'"


@pytest.mark.parametrize("text, found", [("4<|im_end|>\n<|endoftext|>", (len("4<|im_end|>"), "<|im_end|>")),
                                         ("4<|endoftext|><|im_end|>", (len("4<|endoftext|>"), "<|endoftext|>")),
                                         ("4", None)])
def test_the_first_stop_is_the_earliest_in_the_text_whatever_the_order_of_the_stops(text, found):
    assert first_stop(text, ["<|im_end|>", "<|endoftext|>"]) == found


def test_a_stop_is_read_with_the_white_space_before_it():
    stops = ["<|end|>"]
    assert first_stop_with_space("6 \n<|end|>more", stops) == " \n<|end|>"
    assert first_stop_with_space("6", stops) == ""
    assert stop_at("\n<|end|>rest", stops) == "\n<|end|>" and stop_at("x<|end|>", stops) == ""


def test_a_tool_definitions_name_in_openais_form_or_bare_and_none_otherwise():
    assert tool_name({"type": "function", "function": {"name": "get_weather"}}) == "get_weather"
    assert tool_name({"name": "get_weather", "parameters": {}}) == "get_weather"
    assert tool_name({"function": {"name": 3}}) is None and tool_name({}) is None
