"""The labelling on the published chat templates of 2024-26 model families (`tests/real_templates.py`), checked
against what each family's template and configs say an answer trains as: every answer with its stop token, the
next turn's header never, reasoning where the template renders it, tool calls with their turn; refusals naming
their real cause.

The templates are not part of this project: `SFT_REAL_TEMPLATES=<dir>` (e.g. a llama.cpp checkout's
`models/templates`) runs these tests; without it they are skipped. docs/templates.md lists the outcomes."""

import os
from pathlib import Path

import pytest
from real_templates import FAMILIES, template_tokens

from sft.data.chat.settings import configure_chat
from sft.data.chat.template import ChatRenderer, Refused
from sft.data.chat.turns import chat_views
from sft.data.spec import Labelling

TEMPLATES = Path(os.environ.get("SFT_REAL_TEMPLATES", "/nonexistent"))


pytestmark = pytest.mark.skipif(not TEMPLATES.is_dir(), reason="SFT_REAL_TEMPLATES names no folder of templates")


SYSTEM = {"role": "system", "content": "Be brief."}


PLAIN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye!"}]


REASONED = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye!", "reasoning_content": "Say bye."}]


ANSWERS = [("Hello!", "Greet back."), ("Goodbye!", "Say bye.")]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "The city"}}, "required": ["city"]}}}]


AGENT = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"},
         {"role": "assistant", "content": "It is 18 C."}]


def tokenizer_for(name: str):
    """The tiny tokenizer with the family's template, its tokens, bos/eos and its generation config's stop tokens."""
    from sft.model.loading import load_tokenizer

    spec = FAMILIES[name]
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path} is not there")
    template = path.read_text(encoding="utf-8")
    tokenizer = load_tokenizer("tiny", chat_template=template)
    tokenizer.add_tokens(sorted(set(spec.get("special", [])) | set(template_tokens(template))), special_tokens=True)
    tokenizer.add_tokens(spec.get("added", []))
    if spec.get("bos"):
        tokenizer.bos_token = spec["bos"]
    tokenizer.eos_token = spec["eos"]
    return configure_chat(tokenizer, spec.get("kwargs"), spec.get("stops"), None, name)


def trained(tokenizer, messages, tools=None, **knobs) -> tuple[list[str], int]:
    """Each trained span's text, over all the texts a chat trains as, in the order of its turns (a later turn has
    more chat before it), and how many turns' reasoning went untrained (`knobs`: `Labelling`'s)."""
    views = chat_views(tokenizer, messages, tools=tools, labelling=Labelling(**knobs))
    spans = sorted((a, text[a:b]) for text, found in views for a, b, _ in found)
    return [run for _, run in spans], views.untrained_reasoning


def expected(pattern: str, answers) -> list[str]:
    return [pattern.format(a=a, r=r) for a, r in answers]


def check_the_oracle_properties(spec, runs: list[str], answers) -> None:
    """What any answer must train as, whatever the family: its own text, one stop token of the model at its end
    (unless the family has none), and no text of the user's turns."""
    for run, (a, _) in zip(runs, answers):
        assert a in run
        assert "Hi" not in run.replace(a, "") and "Bye" not in run.replace(a, "")  # the questions are context
        if not spec.get("no_stop"):
            assert any(run.endswith(stop) for stop in spec["stops"]), (run, spec["stops"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_answer_trains_as_the_template_writes_it_through_its_stop_token(name):
    spec, tokenizer = FAMILIES[name], tokenizer_for(name)
    prefill_after = spec.get("prefill_after")
    if "refuses" in spec:
        with pytest.raises(Refused) as e:
            chat_views(tokenizer, [SYSTEM, *PLAIN])
        assert spec["refuses"] in e.value.reason
        if "no_system" in spec:  # refused for its system turn alone
            runs, _ = trained(tokenizer, PLAIN)
            assert runs == expected(spec["no_system"], ANSWERS)
        if prefill_after:  # data.prefill=after trains the answer after the generation prompt's prefill
            runs, _ = trained(tokenizer, [SYSTEM, *PLAIN], prefill="after")
            assert runs == expected(prefill_after, ANSWERS)
            check_the_oracle_properties(spec, runs, ANSWERS)
        if spec.get("prefill_after_refused"):  # after an open <think> prefill: inside the block, never closed
            with pytest.raises(Refused, match="does not close"):
                trained(tokenizer, [SYSTEM, *PLAIN], prefill="after")
            assert "data.prefill=after" not in e.value.reason  # nor offered
        return
    runs, untrained = trained(tokenizer, [SYSTEM, *PLAIN])
    assert runs == expected(spec["answer"], ANSWERS)
    assert untrained == 0
    check_the_oracle_properties(spec, runs, ANSWERS)


@pytest.mark.parametrize("name", sorted(n for n, s in FAMILIES.items()
                                         if "answer" in s and "reasoning_refuses" not in s))
def test_reasoning_trains_where_the_template_renders_it_and_is_counted_where_it_does_not(name):
    spec, tokenizer = FAMILIES[name], tokenizer_for(name)
    runs, untrained = trained(tokenizer, REASONED)
    patterns = spec.get("reasoning") or spec["answer"]
    patterns = [patterns] * len(ANSWERS) if isinstance(patterns, str) else patterns
    assert runs == [p.format(a=a, r=r) for p, (a, r) in zip(patterns, ANSWERS)]
    assert untrained == sum("{r}" not in p for p in patterns)  # each answer whose reasoning is not trained, counted


@pytest.mark.parametrize("name", sorted(n for n, s in FAMILIES.items() if "reasoning_refuses" in s))
def test_an_answer_with_reasoning_is_refused_for_its_real_cause_naming_the_templates_switch(name):
    """A template that closes the reasoning in its generation prompt (Gemma-4's empty thought block): the refusal of a
    reasoning row says so and names the kwarg the template reads to open it."""
    spec, tokenizer = FAMILIES[name], tokenizer_for(name)
    with pytest.raises(Refused) as e:
        chat_views(tokenizer, REASONED)
    for part in spec["reasoning_refuses"]:
        assert part in e.value.reason


@pytest.mark.parametrize("name", sorted(n for n, s in FAMILIES.items() if s.get("tools") or s.get("call_ends_with")))
def test_a_chat_that_ends_with_a_call_trains_the_token_the_model_stops_at(name):
    """The call turn, last: through a stop token, or (Apertus: `<|tools_suffix|>` and no end of turn) refused naming
    the stop tokens that would train it (it trained with none, and no word)."""
    spec, tokenizer = FAMILIES[name], tokenizer_for(name)
    if spec.get("call_ends_with"):
        with pytest.raises(Refused) as e:
            trained(tokenizer, AGENT[:2], tools=TOOLS)
        assert "ends this tool-calling turn with no token the model could stop at" in e.value.reason
        assert f"add it to the stop tokens: tokenizer.stop_tokens=[{','.join(spec['stops'])}," \
               f"{spec['call_ends_with']}]" in e.value.reason
        return
    runs, _ = trained(tokenizer, AGENT[:2], tools=TOOLS)
    assert any(runs[-1].endswith(stop) for stop in ChatRenderer(tokenizer).profile.stops), runs[-1]


@pytest.mark.parametrize("name", sorted(n for n, s in FAMILIES.items() if s.get("tools")))
def test_a_tool_call_trains_with_its_turn_and_the_arguments_reach_the_template_as_it_reads_them(name):
    spec, tokenizer = FAMILIES[name], tokenizer_for(name)
    runs, _ = trained(tokenizer, AGENT, tools=TOOLS)
    call = spec["tools"].format()
    final = spec.get("answer", spec.get("tool_answer", "{a}")).format(a="It is 18 C.", r="")
    assert runs == [call, final]
    assert "18 C\n" not in call  # the tool's result is context


def test_the_profile_names_each_familys_stops_and_prefill():
    """The template's own account (what `sft.commands.inspect` and the data log show): the model's stop tokens, and a
    generation prompt's prefill where the family has one."""
    for name, spec in FAMILIES.items():
        if not (TEMPLATES / f"{name}.jinja").exists():
            continue
        profile = ChatRenderer(tokenizer_for(name)).profile
        assert set(spec["stops"]) <= set(profile.stops), name
        # a prefill the template also writes into the finished chat (Nemotron-Nano-v2's) is no prefill of the profile
        has_prefill = "prefill_after" in spec or spec.get("prefill_after_refused")
        assert bool(profile.prefill) == bool(has_prefill and not spec.get("prefill_in_chat")), name
