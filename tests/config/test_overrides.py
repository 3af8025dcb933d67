"""Overrides as sft prints them (`sft.config.overrides`): every one parses in Hydra's grammar as printed and pastes
into a shell, those written out by hand in sft's messages and those its refusals print on real templates."""

import ast
import re
import shlex

import pytest
from conftest import REPO

from sft.config.overrides import override, quoted

# an override as a message prints it: shell-quoted whole, or key=value up to where the sentence goes on
PRINTED = re.compile(r"""'\+?[a-z_][\w.]*=[^']*'|(?<![\w.\-/])\+?[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+=(?:\[[^\]]*\]|[^\s,;)'`"\]]+)""")


def parses(text: str) -> bool:
    """Whether an override, as pasted into a shell, parses in Hydra's grammar."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = shlex.split(text)
    try:
        OverridesParser.create().parse_overrides(words)
    except Exception:  # noqa: BLE001 - any parse failure: the override does not paste
        return False
    return len(words) == 1


@pytest.mark.parametrize("key, value, add, printed", [
    ("tokenizer.stop_tokens", ["<|assistant_end|>", "<|tools_suffix|>"], False,
     """'tokenizer.stop_tokens=["<|assistant_end|>","<|tools_suffix|>"]'"""),
    ("tokenizer.chat_template_kwargs.enable_thinking", True, True, "+tokenizer.chat_template_kwargs.enable_thinking=true"),
    ("tokenizer.chat_template_kwargs.reasoning_effort", "high", True,
     "+tokenizer.chat_template_kwargs.reasoning_effort=high"),
    ("data.train_file", "/data/données de test.jsonl", False, """'data.train_file="/data/données de test.jsonl"'"""),
    ("trainer.learning_rate", 2e-4, False, "trainer.learning_rate=0.0002"),
    ("data.prefill", "true", False, """'data.prefill="true"'"""),  # a string that Hydra would read as a boolean
    ("tokenizer.chat_template", "{{ m['content'] }}", False, """'tokenizer.chat_template="{{ m['"'"'content'"'"'] }}"'"""),
])
def test_an_override_parses_in_hydra_and_pastes_into_a_shell_as_printed(key, value, add, printed):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert override(key, value, add) == printed
    parsed = OverridesParser.create().parse_overrides(shlex.split(printed))[0]
    assert parsed.key_or_group == key and parsed.value() == value


@pytest.mark.parametrize("typed", ["tokenizer.stop_tokens=[<|a|>,<|b|>]", "data.train_file=/données.jsonl",
                                   "tokenizer.stop_tokens=['<|a|>', <|b|>]"])
def test_an_override_hydra_cannot_parse_is_given_back_in_a_form_it_can(typed):
    assert not parses(shlex.quote(typed)) and parses(quoted(typed))


def test_every_override_written_out_in_sfts_messages_parses_as_printed():
    """The overrides spelled out in the package's strings (advice, refusals, help), the formatted ones aside (the
    refusals below print those)."""
    found = set()
    for path in (REPO / "sft").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "=" in node.value:
                found |= {(path.name, m) for m in PRINTED.findall(node.value) if "{" not in m and "<" not in m}
    assert len(found) > 20, found
    bad = sorted(f"{name}: {text}" for name, text in found if not parses(text))
    assert not bad, bad


def test_every_override_a_refusal_prints_on_real_templates_parses_as_printed():
    """The refusals that name an override built from the template (its stop tokens, its reasoning switch): the stop
    tokens' once printed `tokenizer.stop_tokens=[<|assistant_end|>,<|tools_suffix|>]`, which Hydra failed to parse."""
    from chat_templates import family_tokenizer
    from chat_views import PLAIN, REASONED_CHAT
    from tool_chats import WEATHER_CHAT, WEATHER_TOOLS

    from sft.data.chat.settings import configure_chat
    from sft.data.chat.template import Refused
    from sft.data.chat.turns import chat_views

    said = []
    for tokenizer, chat, tools in [
        (family_tokenizer("call_without_stop"), WEATHER_CHAT[:2], WEATHER_TOOLS),
        (family_tokenizer("upper_thinking_switch"), REASONED_CHAT, None),
        (family_tokenizer("suffixed_think_effort"), REASONED_CHAT, None),
        (configure_chat(family_tokenizer("no_think_prompt"), {"enable_thinking": False}), REASONED_CHAT, None),
        (family_tokenizer("prefilled_think"), PLAIN, None),
    ]:
        with pytest.raises(Refused) as refused:
            chat_views(tokenizer, chat, tools)
        said.append(refused.value.reason)
    printed = [m for reason in said for m in PRINTED.findall(reason)]
    assert any("stop_tokens" in p for p in printed) and any("chat_template_kwargs" in p for p in printed), printed
    assert all(parses(p) for p in printed), [p for p in printed if not parses(p)]
