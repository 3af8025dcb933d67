"""The published chat templates of 2024-26 model families, as a user brings them, and what each trains.

The templates themselves are not part of this project: `SFT_REAL_TEMPLATES=<dir>` names a folder of them, one
`<name>.jinja` each, as llama.cpp keeps verbatim copies under `models/templates/` (see docs/templates.md).
For each, `FAMILIES` states what the labelling is checked against, written from reading the template and
the model's published configs, not from this project's output:

- `bos`, `eos`: the tokenizer's; `stops`: the eos ids of the model's `generation_config.json`, as tokens (None:
  not published or not known here; the tokenizer's eos alone); `special`/`added`: tokens the template writes that
  the tiny test vocabulary must hold as single tokens (special ones, and added ones like Qwen3's `<think>`);
- `kwargs`, `prefill`: the run's `tokenizer.chat_template_kwargs` and `data.prefill`;
- `answer`: what each answer of a plain chat trains as (`{a}` the answer; `{r}` its reasoning); `reasoning`: the
  same for answers with reasoning (None: the template renders no reasoning; a list: each answer's); `refuses`:
  the refusal a plain chat gets instead, a part of its reason; `no_system`: what it trains without its system
  turn; `prefill_after`: what it trains with `data.prefill=after` (`prefill_after_refused`: refused, as it would train
  inside the prefill's open reasoning block); `no_stop`: the template writes no stop;
- `tools`: what an answer that calls a tool trains as (`{call}`: where the call is written), None where not checked;
  `call_ends_with`: the token a call ends with where no stop token follows it (a chat ending with a call is refused);
- `reasoning_refuses`: parts of the refusal an answer with reasoning gets (where the family refuses plain chats);
  `prefill_in_chat`: the template writes its prefill into the finished chat too (the profile sees none).
"""

import re

# What looks like a special token in a template's text: <|...|>, <｜...｜>, [INST]-like tags, <start_of_turn>-like
SPECIAL_LOOKING = re.compile(r"<\|[^<>|\s]{1,40}\|>|<｜[^<>｜]{1,40}｜>|\[/?[A-Z_]{3,20}\]|<(?:start|end)_of_turn>|"
                             r"<\|?[A-Z_]+_TOKEN\|?>|<SPECIAL_\d+>|<seed:[a-z_]+>|</seed:[a-z_]+>")


def template_tokens(template: str) -> list[str]:
    """The special-looking tokens a template writes (the tiny vocabulary must hold each as one token)."""
    return sorted(set(SPECIAL_LOOKING.findall(template)))


CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
           "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[THINK]", "[/THINK]", "[ARGS]"]
THINK = ["<think>", "</think>"]
QWEN_STOPS = ["<|im_end|>", "<|endoftext|>"]
LLAMA_STOPS = ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]

FAMILIES = {
    # --- Qwen ---------------------------------------------------------------------------------------------
    "Qwen-Qwen2.5-7B-Instruct": dict(
        family="Qwen2.5", special=CHATML, eos="<|im_end|>", stops=QWEN_STOPS, answer="{a}<|im_end|>",
        reasoning=None,
        tools='<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call><|im_end|>'),
    "Qwen-Qwen3-0.6B": dict(
        family="Qwen3", special=CHATML, added=THINK, eos="<|im_end|>", stops=QWEN_STOPS,
        answer="<think>\n\n</think>\n\n{a}<|im_end|>", reasoning="<think>\n{r}\n</think>\n\n{a}<|im_end|>",
        tools='<think>\n\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n'
              '</tool_call><|im_end|>'),
    "Qwen-QwQ-32B": dict(
        family="QwQ", special=CHATML, added=THINK, eos="<|im_end|>", stops=QWEN_STOPS,
        refuses="generation prompt ends with '<think>\\n</think>'", prefill_after="{a}<|im_end|>",
        reasoning_refuses=["the generation prompt closes the reasoning ('<think>\\n</think>'",
                           "+tokenizer.chat_template_kwargs.enable_thinking=true"]),
    "Qwen3-Coder": dict(
        family="Qwen3-Coder", special=CHATML, eos="<|im_end|>", stops=QWEN_STOPS, answer="{a}<|im_end|>",
        reasoning=None,
        tools="<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
              "</tool_call><|im_end|>"),
    "Qwen3.5-4B": dict(
        family="Qwen3.5", special=CHATML, added=THINK, eos="<|im_end|>", stops=QWEN_STOPS,
        answer="\n</think>\n\n{a}<|im_end|>", reasoning="{r}\n</think>\n\n{a}<|im_end|>",
        tools="\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
              "</tool_call><|im_end|>"),
    # --- Llama ---------------------------------------------------------------------------------------------
    "meta-llama-Llama-3.1-8B-Instruct": dict(
        family="Llama-3.1", special=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", stops=LLAMA_STOPS,
        answer="{a}<|eot_id|>", reasoning=None,
        tools='{{"name": "get_weather", "parameters": {{"city": "Paris"}}}}<|eot_id|>'),
    "meta-llama-Llama-3.2-3B-Instruct": dict(
        family="Llama-3.2", special=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", stops=LLAMA_STOPS,
        answer="{a}<|eot_id|>", reasoning=None),
    "meta-llama-Llama-3.3-70B-Instruct": dict(
        family="Llama-3.3", special=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", stops=LLAMA_STOPS,
        answer="{a}<|eot_id|>", reasoning=None),
    # --- Gemma ---------------------------------------------------------------------------------------------
    "google-gemma-2-2b-it": dict(
        family="Gemma-2", special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>",
        stops=["<eos>", "<end_of_turn>"], refuses="System role not supported", no_system="{a}<end_of_turn>",
        tools_refuses="Conversation roles must alternate"),
    "google-gemma-3-it": dict(
        family="Gemma-3", special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>",
        stops=["<eos>", "<end_of_turn>"], answer="{a}<end_of_turn>", reasoning=None,
        tools_refuses="Conversation roles must alternate"),
    # --- Phi -----------------------------------------------------------------------------------------------
    "microsoft-Phi-3.5-mini-instruct": dict(
        family="Phi-3.5", special=["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        bos="<s>", eos="<|endoftext|>", stops=["<|end|>", "<|assistant|>", "<|endoftext|>"], answer="{a}<|end|>",
        reasoning=None,
        tools_refuses="does not render the tool definitions"),
    "microsoft-phi-4": dict(
        family="Phi-4", special=["<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|endoftext|>"], eos="<|im_end|>",
        stops=["<|im_end|>"], answer="{a}<|im_end|>", reasoning=None,
        tools_refuses="does not render the tool definitions"),
    # --- Mistral -------------------------------------------------------------------------------------------
    "mistralai-Mistral-Nemo-Instruct-2407": dict(
        family="Mistral-Nemo", special=MISTRAL, bos="<s>", eos="</s>", stops=["</s>"],
        refuses="renders the chat before this turn differently", no_system="{a}</s>",
        tools_refuses="Tool call IDs should be alphanumeric strings with length 9"),
    "Mistral-Small-3.2-24B-Instruct-2506": dict(
        family="Mistral-Small-3.2", special=MISTRAL, bos="<s>", eos="</s>", stops=["</s>"], answer="{a}</s>",
        reasoning=None,
        tools_refuses="Tool call IDs should be alphanumeric strings with length 9"),
    "mistralai-Ministral-3-14B-Reasoning-2512": dict(
        family="Ministral-3", special=MISTRAL, bos="<s>", eos="</s>", stops=["</s>"], answer="{a}</s>",
        reasoning=None,  # rendered from a content's "thinking" chunks only, not from reasoning_content
        tools='[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}</s>'),
    "unsloth-mistral-Devstral-Small-2507": dict(
        family="Devstral", special=MISTRAL, bos="<s>", eos="</s>", stops=["</s>"], answer="{a}</s>", reasoning=None,
        tools='[TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}</s>'),
    # --- Cohere --------------------------------------------------------------------------------------------
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": dict(
        family="Command-R7B", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", stops=["<|END_OF_TURN_TOKEN|>"],
        special=["<BOS_TOKEN>"], refuses="generation prompt ends with '<|START_THINKING|><|END_THINKING|>'",
        prefill_after="<|START_RESPONSE|>{a}<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
        reasoning_refuses=["the generation prompt closes the reasoning ('<|START_THINKING|><|END_THINKING|>'",
                           "+tokenizer.chat_template_kwargs.enable_thinking=true"]),
    "CohereForAI-c4ai-command-r-plus-tool_use": dict(
        family="Command-R+", bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", stops=["<|END_OF_TURN_TOKEN|>"],
        special=["<BOS_TOKEN>"], refuses="TypeError: 'NoneType' object is not iterable",
        tools_refuses="renders the chat before this turn differently"),
    # --- GLM -----------------------------------------------------------------------------------------------
    "GLM-4.6": dict(
        family="GLM-4.6", special=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                   "<|endoftext|>"], added=THINK,
        eos="<|endoftext|>", stops=["<|endoftext|>", "<|user|>", "<|observation|>"],
        answer="\n<think></think>\n{a}<|user|>", reasoning="\n<think>{r}</think>\n{a}<|user|>",
        tools="\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call><|observation|>"),
    # --- gpt-oss -------------------------------------------------------------------------------------------
    "openai-gpt-oss-120b": dict(
        family="gpt-oss", special=["<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                   "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>"],
        bos="<|startoftext|>", eos="<|return|>", stops=["<|return|>", "<|endoftext|>", "<|call|>"],
        answer="<|channel|>final<|message|>{a}<|return|>",
        reasoning="<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>{a}<|return|>",
        tools=' to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "Paris"}}<|call|>'),
    # --- DeepSeek ------------------------------------------------------------------------------------------
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": dict(
        family="DeepSeek-R1-Distill (Qwen)", special=DEEPSEEK, bos="<｜begin▁of▁sentence｜>",
        # llama.cpp's copy prefilled '<think>\n</think>' in 2026-08 and '<think>\n' since: either refuses
        eos="<｜end▁of▁sentence｜>", stops=["<｜end▁of▁sentence｜>"], refuses="generation prompt ends with '<think>\\n",
        prefill_after="{a}<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": dict(
        family="DeepSeek-R1-Distill (Llama)", special=DEEPSEEK, bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>", stops=["<｜end▁of▁sentence｜>"], refuses="generation prompt ends with '<think>\\n'",
        prefill_after_refused=True,
        tools_refuses="does not render the tool definitions"),
    "deepseek-ai-DeepSeek-V3.1": dict(
        family="DeepSeek-V3.1", special=DEEPSEEK, added=THINK, bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>", stops=["<｜end▁of▁sentence｜>"], answer="{a}<｜end▁of▁sentence｜>", reasoning=None,
        tools='<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "Paris"}}<｜tool▁call▁end｜>'
              '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'),
    "deepseek-ai-DeepSeek-V3.2": dict(
        family="DeepSeek-V3.2", special=DEEPSEEK, added=THINK, bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>", stops=["<｜end▁of▁sentence｜>"],
        refuses="generation prompt ends with '<think></think>'", prefill_after="{a}<｜end▁of▁sentence｜>"),
    # --- others --------------------------------------------------------------------------------------------
    "HuggingFaceTB-SmolLM3-3B": dict(
        family="SmolLM3", special=CHATML, added=THINK, eos="<|im_end|>", stops=["<|im_end|>"],
        answer="{a}<|im_end|>", reasoning=None,
        tools_refuses="does not render the tool definitions"),
    "ibm-granite-granite-3.3-2B-Instruct": dict(
        family="Granite-3.3", special=["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"],
        bos="<|end_of_text|>", eos="<|end_of_text|>", stops=["<|end_of_text|>"], answer="{a}<|end_of_text|>",
        reasoning=None,
        tools_refuses="does not render this turn's tool call"),
    "ibm-granite-granite-4.0": dict(
        family="Granite-4.0", special=["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"],
        eos="<|end_of_text|>", stops=["<|end_of_text|>"], answer="{a}<|end_of_text|>", reasoning=None,
        tools='<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call><|end_of_text|>'),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": dict(
        family="Hermes-3 (tool_use)", special=CHATML + LLAMA3, bos="<|begin_of_text|>", eos="<|im_end|>",
        stops=["<|im_end|>"], refuses="a tool-use template may need the row's tools",
        tools='<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call><|im_end|>',
        tool_answer="{a}<|im_end|>"),
    "moonshotai-Kimi-K2": dict(
        family="Kimi-K2", special=["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                                   "[EOS]", "[BOS]"], bos="[BOS]", eos="[EOS]", stops=["<|im_end|>"],
        answer="{a}<|im_end|>", reasoning=None,
        tools='<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
              '{{"city": "Paris"}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'),
    "MiniMax-M2": dict(
        family="MiniMax-M2", special=["]~!b[", "]~b]", "[e~["], added=THINK, bos="]~!b[", eos="[e~[", stops=["[e~["],
        refuses="generation prompt ends with '<think>\\n'", prefill_after_refused=True),
    "LFM2-8B-A1B": dict(
        family="LFM2", special=CHATML + ["<|startoftext|>"], bos="<|startoftext|>", eos="<|im_end|>",
        stops=["<|im_end|>"], answer="{a}<|im_end|>", reasoning=None,
        tools_refuses="does not render this turn's tool call"),
    "ByteDance-Seed-OSS": dict(
        family="Seed-OSS", special=["<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>"], bos="<seed:bos>",
        eos="<seed:eos>", stops=["<seed:eos>"], answer="{a}<seed:eos>",
        reasoning="<seed:think>{r}</seed:think>\n{a}<seed:eos>",
        tools="<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n"
              "</seed:tool_call><seed:eos>"),
    "llama-cpp-rwkv-world": dict(
        family="RWKV World", eos="<|endoftext|>", special=["<|endoftext|>"], stops=["<|endoftext|>"],
        answer=" {a}", reasoning=None, no_stop=True,
        tools_refuses="does not render the tool definitions"),
}

# Families whose generation config is not known here: the stop token is the tokenizer's eos as the template writes it.
FAMILIES.update({
    "Apertus-8B-Instruct": dict(
        family="Apertus", special=["<s>", "<|system_start|>", "<|system_end|>", "<|developer_start|>",
                                   "<|developer_end|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                                   "<|assistant_end|>", "<|inner_prefix|>", "<|inner_suffix|>"],
        bos="<s>", eos="<|assistant_end|>", stops=["<|assistant_end|>"], answer="{a}<|assistant_end|>",
        reasoning=None,
        tools_refuses="renders the chat before this turn differently", call_ends_with="<|tools_suffix|>"),
    "moonshotai-Kimi-K2-Thinking": dict(
        family="Kimi-K2-Thinking", special=["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                                            "<|im_end|>", "[EOS]", "[BOS]"], added=THINK, bos="[BOS]", eos="[EOS]",
        stops=["<|im_end|>"], answer="<think></think>{a}<|im_end|>",
        # its reasoning only after the first answer of the chat (it looks for the last answer but keeps the first)
        reasoning=["<think></think>{a}<|im_end|>", "<think>{r}</think>{a}<|im_end|>"],
        tools_refuses="access to attribute 'append' of 'list' object is unsafe"),
    "GLM-4.7-Flash": dict(
        family="GLM-4.7", special=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                   "<|endoftext|>"], added=THINK,
        eos="<|endoftext|>", stops=["<|endoftext|>", "<|user|>", "<|observation|>"],
        refuses="generation prompt ends with '<think>'", prefill_after="</think>{a}<|user|>"),
    # its generation prompt's <think>\n\n is written before the finished chat's last answer too: every answer would
    # train inside an open think block (issue 48); '/no_think' in the system prompt closes it (<think></think>)
    "NVIDIA-Nemotron-Nano-v2": dict(
        family="Nemotron-Nano-v2", special=["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"], added=THINK,
        eos="<SPECIAL_12>", stops=["<SPECIAL_12>"],
        refuses="opens a reasoning block before this answer ('<think>\\n", prefill_after_refused=True,
        prefill_in_chat=True,
        tools_refuses="renders the chat before this turn differently"),
    # Gemma-4 (llama.cpp's gemma4.jinja): an empty thought block closes every generation prompt unless enable_thinking
    # is passed; answers' thoughts are stripped from the chat (strip_thinking), so reasoning never trains
    "gemma4": dict(
        family="Gemma-4", special=["<bos>", "<eos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>",
                                   "<|tool_call>", "<tool_call|>", "<|tool>", "<tool|>", '<|"|>', "<|tool_response>",
                                   "<tool_response|>"],
        bos="<bos>", eos="<turn|>", stops=["<turn|>"], refuses="generation prompt ends with '<|channel>thought\\n<channel|>'",
        prefill_after="{a}<turn|>",
        reasoning_refuses=["generation prompt closes the reasoning ('<|channel>thought\\n<channel|>'",
                           "+tokenizer.chat_template_kwargs.enable_thinking=true"]),
    # Hunyuan Hy3 (llama.cpp's tencent-Hy3.jinja): every tag suffixed ':opensource'; reasoning_effort=no_think by
    # default closes an empty think block in the generation prompt; with reasoning_effort=high the reasoning trains
    "tencent-Hy3": dict(
        family="Hy3", special=["<｜hy_eos:opensource｜>", "<｜hy_User:opensource｜>", "<｜hy_Assistant:opensource｜>",
                               "<｜hy_begin_of_sentence:opensource｜>", "<｜reasoning_mode:opensource｜>",
                               "<｜hy_pad:opensource｜>", "<think:opensource>", "</think:opensource>",
                               "<tool_calls:opensource>", "</tool_calls:opensource>", "<tool_call:opensource>",
                               "</tool_call:opensource>", "<tool_sep:opensource>", "<arg_key:opensource>",
                               "</arg_key:opensource>", "<arg_value:opensource>", "</arg_value:opensource>",
                               "<tool_responses:opensource>", "</tool_responses:opensource>",
                               "<tool_response:opensource>", "</tool_response:opensource>"],
        eos="<｜hy_eos:opensource｜>", stops=["<｜hy_eos:opensource｜>"], answer="{a}<｜hy_eos:opensource｜>",
        reasoning_refuses=["the generation prompt closes the reasoning",
                           "+tokenizer.chat_template_kwargs.reasoning_effort=high"],
        tools="<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n<arg_key:opensource>city"
              "</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n</tool_call:opensource>\n"
              "</tool_calls:opensource><｜hy_eos:opensource｜>"),
    # Kimi-K3: XML-like tags; thinking on by default, the generation prompt opens the think tag, every answer's
    # reasoning rendered in it; object arguments as typed <argument> tags
    "Kimi-K3": dict(
        family="Kimi-K3", special=["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"], eos="<|end_of_msg|>",
        stops=["<|end_of_msg|>"],
        answer="<|close|>think<|sep|><|open|>response<|sep|>{a}<|close|>response<|sep|><|close|>message<|sep|>"
               "<|end_of_msg|>",
        reasoning="{r}<|close|>think<|sep|><|open|>response<|sep|>{a}<|close|>response<|sep|><|close|>message<|sep|>"
                  "<|end_of_msg|>",
        tools='<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call '
              'tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>'
              'argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>',
        tool_answer="<|close|>think<|sep|><|open|>response<|sep|>{a}<|close|>response<|sep|><|close|>message<|sep|>"
                    "<|end_of_msg|>"),
    "LFM2.5-8B-A1B": dict(
        family="LFM2.5", special=["<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>",
                                  "<|tool_call_end|>"], added=THINK,
        bos="<|startoftext|>", eos="<|im_end|>", stops=["<|im_end|>"], answer="{a}<|im_end|>",
        reasoning="<think>{r}</think>{a}<|im_end|>",
        tools="<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|><|im_end|>"),
    "Apriel-1.6-15b-Thinker-fixed": dict(
        family="Apriel-1.6", special=["<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>",
                                      "<|begin_tool_result|>", "<|begin_content|>", "<|end|>"],
        eos="<|end|>", stops=["<|end|>"], refuses="generation prompt ends with 'Here are my reasoning steps:\\n'",
        prefill_after="{a}\n<|end|>"),
})
