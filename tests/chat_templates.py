"""Chat templates of the major model families, written for the tests in the style of each family's
published template (same framing, special tokens and rewriting rules), on the tiny BPE vocabulary.

Each family: its template, its special tokens, bos/eos, its generation config's stop tokens where they are more
than its eos (`stops`), and how an assistant answer `a` is trained (`answer`: the text of its trained tokens;
the chat's last answer may end differently, `last_answer`).
"""

from sft.model.loading import CHATML_TEMPLATE

# Qwen3: ChatML; reasoning (`reasoning_content`, or a `<think>` block in the content) is rendered only for
# answers after the last user turn: earlier answers lose it once a later user turn follows.
QWEN3 = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3.1/3.2: a system header with a knowledge cutoff and today's date (strftime_now), always present.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Gemma 2/3: no system role (its text opens the first user turn), the assistant is `model`, strict alternation.
GEMMA = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Mistral-7B-Instruct-v0.3: [INST] framing; the system prompt goes into the user turn that is the chat's
# last message, so a chat ending with an answer loses it.
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# Phi-3/3.5-mini: <|role|> headers closed by <|end|>; a chat (not a prompt) ends with the eos token.
PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Qwen2.5 with tools: the definitions in the system turn, each call a <tool_call> JSON block in its assistant
# turn, consecutive tool results one user turn of <tool_response> blocks.
QWEN25_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}"
    "{%- endif %}{{- '\n\n# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments | tojson"
    " + '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Mistral-Nemo's rule for call ids (9 alphanumeric characters, else raise_exception) and its `arguments | tojson`:
# a probe call with another id learns nothing, and a row's JSON-text arguments would train double-encoded.
STRICT_IDS = (
    "{%- if tools %}{{- '<|im_start|>system\n[AVAILABLE_TOOLS]' + tools | tojson + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\n' }}"
    "{%- for c in m.tool_calls %}{%- if not c.id or c.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' + c.function.arguments | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# DeepSeek-V3.1's way with tools: calls rendered, definitions never (no `tools` in the template at all).
NO_DEFINITIONS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\n' }}"
    "{%- for c in m.tool_calls %}{{- '<tool_call>' + c.function.name + ' ' + c.function.arguments | tojson + "
    "'</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Apertus's: each tool definition read bare (`tool.name`, `tool.parameters`), its parameters written TypeScript-style;
# OpenAI's form ({type, function: {...}}) renders as a nameless tool
BARE_DEFINITIONS = (
    "{%- if tools %}{{- '<|im_start|>system\nTools:' }}"
    "{%- for t in tools %}{{- '\ntype ' + (t.name or '') + ' = (_: {' }}"
    "{%- for p in (t.parameters or {}).get('properties', {}) %}{{- p + ': any, ' }}{%- endfor %}{{- '}) => any;' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}{{- '<tool_call>' + c.function.name + ' ' + "
    "c.function.arguments | tojson + '</tool_call>' }}{%- endfor %}"
    "{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# LFM2's: a call-only turn's content written as JSON (`| tojson`: null for a null content)
JSON_CONTENT = (
    "{%- if tools %}{{- '<|im_start|>system\nTools: ' + tools | tojson + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}{{- '<tool_call>' + c.function.name + '(' + "
    "c.function.arguments | tojson + ')</tool_call>' }}{%- endfor %}{{- '\n' + m.content | tojson }}"
    "{%- else %}{{- m.content }}{%- endif %}{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Apriel-1.6's: a turn's call written with its id, and its end token, only once the chat goes on past it
IDS_ONCE_CONTINUED = (
    "{%- if tools %}{{- '<|im_start|>system\nTools: ' + tools | tojson + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{%- set last = loop.last %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{- '<tool_calls>[' }}{%- for c in m.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments | tojson }}"
    "{%- if not last %}{{- ', \"id\": \"' + c.id + '\"' }}{%- endif %}{{- '}' }}{%- endfor %}{{- ']</tool_calls>' }}"
    "{%- endif %}{%- if not last %}{{- '\n<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Qwen3's with enable_thinking=false (and Hunyuan Hy3's by default): the generation prompt closes an empty
# reasoning block, while an answer with reasoning renders it
NO_THINK_PROMPT = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}"
    "{% if m.reasoning_content is string %}<think>{{ '\n' + m.reasoning_content + '\n' }}</think>{{ '\n\n' }}"
    "{% endif %}{{ m.content }}<|im_end|>{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}"
    "{% if enable_thinking is false %}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{% endif %}{% endif %}"
)

FAMILIES = {
    "chatml": dict(template=CHATML_TEMPLATE, special=[], bos=None, eos="<|im_end|>",
                   answer="{a}<|im_end|>"),
    "qwen3": dict(template=QWEN3, special=[], added=["<think>", "</think>"], bos=None, eos="<|im_end|>",
                  answer="<think>\n{r}\n</think>\n\n{a}<|im_end|>"),
    "llama3": dict(template=LLAMA3, special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                             "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>",
                   answer="{a}<|eot_id|>"),
    "gemma": dict(template=GEMMA, special=["<bos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>",
                  eos="<end_of_turn>", answer="{a}<end_of_turn>"),
    "mistral": dict(template=MISTRAL, special=["<s>", "</s>"], bos="<s>", eos="</s>", answer=" {a}</s>"),
    "qwen25_tools": dict(template=QWEN25_TOOLS, special=[], bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    # Phi-3.5's generation_config.json stops at <|end|> (and <|assistant|>, <|endoftext|>: here <|eos|>)
    "phi3": dict(template=PHI3, special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|eos|>"],
                 bos=None, eos="<|eos|>", stops=["<|end|>", "<|assistant|>", "<|eos|>"], answer="{a}<|end|>"),
}


# --- templates that do what some published ones do, to the labelling's cost (issue 28) ---------------------

# gpt-oss (harmony): the eos <|return|> ends only the chat's last answer; an earlier one ends <|end|>, which is no
# stop token: the model writes <|return|> whenever it answers.
EOS_AFTER_LAST = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "{{ '<|return|>' if loop.last else '<|end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

# Command-R7B (tool_use): the next answer's header after every chat, whether or not a prompt is asked for.
NEXT_HEADER = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' %}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
    "{% elif m.role == 'user' %}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
    "{% elif m.role == 'assistant' %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{{ m.content }}"
    "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    "{% endif %}{% endfor %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
)

# GLM-4.6: no end-of-turn token; the next role's token (<|user|>, <|observation|>) is what stops generation, as
# its generation config says; the chat's last answer is followed by nothing. Tool calls as <tool_call> blocks,
# their arguments' keys and values written out (an object needed).
NEXT_ROLE_STOPS = (
    "[gMASK]<sop>{% if tools %}{% for t in tools %}<|system|>{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ '\n' + m.content }}"
    "{% elif m.role == 'user' %}<|user|>{{ '\n' + m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>"
    "{% if m.content %}{{ '\n' + m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}{{ '\n<tool_call>' + c.function.name }}"
    "{% if c.function.arguments is not mapping %}{{ raise_exception('arguments must be an object') }}{% endif %}"
    "{% for k, v in c.function.arguments.items() %}{{ '\n<arg_key>' + k + '</arg_key><arg_value>' + v + '</arg_value>' }}"
    "{% endfor %}{{ '\n</tool_call>' }}{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>{{ '\n' + m.content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Hermes-3 (tool_use): loops over `tools` unguarded (a TypeError without them), maps JSON-schema types with a macro
# that recurses on any other type name ("str": a RecursionError), and writes a tool result that ends the chat
# without the newline it writes before a following turn.
TOOLS_REQUIRED = (
    "{% macro type_name(t) %}{% if t == 'string' %}str{% elif t == 'integer' %}int{% elif t == 'object' %}dict"
    "{% else %}{{ type_name(t) }}{% endif %}{% endmacro %}"
    "<|im_start|>system{{ '\n' }}Tools:{% for tool in tools %}{{ '\n' + tool.function.name }}("
    "{% for name, p in tool.function.parameters.properties.items() %}{{ name }}: {{ type_name(p.type) }}"
    "{% endfor %}){% endfor %}<|im_end|>{{ '\n' }}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>tool{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}"
    "{{ '' if loop.last else '\n' }}<|im_end|>{{ '\n' }}"
    "{% else %}<|im_start|>{{ m.role + '\n' + m.content }}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)

# DeepSeek-V3.1: a call's arguments added to text as they are (text needed: an object is a TypeError); a turn's
# content tested for none (an empty text renders an empty answer of its own).
ARGUMENTS_AS_TEXT = (
    "{{ bos_token }}{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% elif m.role == 'assistant' %}"
    "{% if m.tool_calls %}<｜Assistant｜>{% for c in m.tool_calls %}"
    "{{ '<｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments + '<｜tool▁call▁end｜>' }}"
    "{% endfor %}<｜end▁of▁sentence｜>{% endif %}"
    "{% if m.content is not none %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

# Llama-3.1: a tool preamble whenever `tools` is not none (an empty list too), its functions listed after it.
TOOL_PREAMBLE = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>{{ '\n\n' }}"
    "{% if tools is not none %}Environment: ipython{{ '\n' }}You may call these functions:"
    "{% for t in tools %}{{ '\n' }}{{ t.function | tojson }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>"
    "{% for m in messages %}{% if m.role != 'system' %}"
    "<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>{{ '\n\n' }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}{{ c.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\n\n' }}{% endif %}"
)

# DeepSeek-R1 distills and QwQ: the generation prompt prefills <think>, and earlier answers lose their reasoning.
PREFILLED_THINK = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}"
    "{% if loop.last %}{{ m.content }}{% else %}{{ m.content.split('</think>')[-1].lstrip('\n') }}{% endif %}"
    "<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}<think>{{ '\n' }}{% endif %}"
)

# QwQ's and the R1 distills' current copies: every answer's reasoning dropped from the chat (the last one's too); the
# generation prompt closes the think block unless enable_thinking is passed, which opens it but renders no reasoning.
SWITCH_DROPS_REASONING = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}{{ m.content.split('</think>')[-1].lstrip('\n') }}"
    "<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}<think>{{ '\n' }}"
    "{% if not enable_thinking %}</think>{{ '\n\n' }}{% endif %}{% endif %}"
)

# Apertus's pattern: one assistant turn holds its calls and their results; a call ends with <|tools_suffix|>, and the
# turn with <|assistant_end|> only once a user speaks again (no stop token after a call, in the chat or once it goes on).
CALL_WITHOUT_STOP = (
    "{%- set ns = namespace(open=false) -%}"
    "{%- if tools %}<|developer_start|>{{ tools | tojson }}<|developer_end|>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{% if ns.open %}<|assistant_end|>{% set ns.open = false %}{% endif -%}"
    "<|user_start|>{{ m.content }}<|user_end|>"
    "{%- elif m.role == 'assistant' -%}{% if not ns.open %}<|assistant_start|>{% set ns.open = true %}{% endif -%}"
    "{{ m.content or '' }}{% if m.tool_calls %}<|tools_prefix|>["
    "{%- for c in m.tool_calls %}{{ '{\"' + c.function.name + '\": ' }}{{ c.function.arguments | tojson }}}"
    "{% endfor %}]<|tools_suffix|>{% endif -%}"
    "{%- elif m.role == 'tool' %}[{{ m.content }}]{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|assistant_start|>{% endif -%}"
)

# Apertus's first import: a call's arguments concatenated into the text, so an object fails in the template itself
# (`TypeError: can only concatenate str (not "dict") to str`); `strict` also refuses a chat without a system turn
# (the probe chat has none, so the probe cannot tell which form it takes).
ARGUMENTS_CONCATENATED = (
    "{%- if strict and messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif -%}"
    "{%- if tools %}<|im_start|>tools{{ '\n' + tools | tojson }}<|im_end|>{{ '\n' }}{% endif -%}"
    "{% for m in messages %}"
    "{% if m.role in ('system', 'user') %}<|im_start|>{{ m.role + '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>tool{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ '<call>' + c.function.name + ' ' + c.function.arguments + '</call>' }}"
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)

# NVIDIA Nemotron-Nano-v2's pattern: the generation prompt prefills an open <think> block, and the finished chat's last
# answer is written after that same prefill (earlier answers without it); '/no_think' in a message closes it instead.
# A call is written without the prefill (its tools shown first).
PREFILL_IN_LAST_TURN = (
    "{%- set ns = namespace(think=true) -%}"
    "{%- for m in messages %}{% if m.role != 'assistant' and '/no_think' in m.content %}{% set ns.think = false %}"
    "{% endif %}{% endfor -%}"
    "{%- set prefill = '<think>\n\n' if ns.think else '<think></think>' -%}"
    "{%- if tools %}<|im_start|>system{{ '\n' + tools | tojson }}<|im_end|>{{ '\n' }}{% endif -%}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content.replace('/no_think', '').strip() }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>user{{ '\n<tool_response>' + m.content }}</tool_response><|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant{{ '\n' }}"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}{% if loop.last %}{{ prefill }}{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' + prefill }}{% endif %}"
)

# Command-R7B's pattern: an uppercase reasoning block, closed empty in the generation prompt unless the caller passes
# the template's own switch (here `reasoning`), and answers' reasoning rendered only with it; a `{% break %}` (jinja's
# loop controls, which transformers' template environment has) as its template has.
UPPER_THINKING_SWITCH = (
    "{%- for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor -%}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}"
    "{% if reasoning and m.reasoning_content %}<|START_THINKING|>{{ m.reasoning_content }}<|END_THINKING|>{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}"
    "{% if not reasoning %}<|START_THINKING|><|END_THINKING|>{% endif %}{% endif %}"
)

# Hunyuan Hy3's pattern: suffixed reasoning tags (<think:opensource>), closed empty in the generation prompt unless
# reasoning_effort asks for thinking; earlier answers shown without their reasoning.
SUFFIXED_THINK_EFFORT = (
    "{%- set thinking = reasoning_effort is defined and reasoning_effort != 'no_think' -%}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}"
    "{% if thinking and m.reasoning_content %}<think:opensource>{{ m.reasoning_content }}</think:opensource>{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}"
    "{% if not thinking %}<think:opensource>{{ '\n\n' }}</think:opensource>{% endif %}{% endif %}"
)

# Qwen3's thinking switch: enable_thinking=false prefills an empty think block, which every answer then shows.
THINKING_SWITCH = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\n' + m.content }}<|im_end|>{{ '\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\n' }}"
    "{% if m.reasoning_content is string and enable_thinking is not false %}"
    "<think>{{ '\n' + m.reasoning_content + '\n' }}</think>{{ '\n\n' }}"
    "{% elif enable_thinking is false %}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{% endif %}"
    "{{ m.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}"
    "{% if enable_thinking is false %}<think>{{ '\n\n' }}</think>{{ '\n\n' }}{% endif %}{% endif %}"
)

# A template whose turns end with no token at all.
PLAIN_TEXT = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}{{ '\n\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

QUIRKS = {
    "eos_after_last": dict(template=EOS_AFTER_LAST, special=["<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                             "<|return|>", "<|call|>"],
                           bos=None, eos="<|return|>", stops=["<|return|>", "<|call|>"],
                           answer="<|channel|>final<|message|>{a}<|return|>"),
    "next_header": dict(template=NEXT_HEADER, special=["<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
                                                       "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                                                       "<|START_RESPONSE|>", "<|END_RESPONSE|>"],
                        bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>",
                        answer="<|START_RESPONSE|>{a}<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"),
    "next_role": dict(template=NEXT_ROLE_STOPS, special=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                                         "<|observation|>", "<|endoftext|>"],
                      bos=None, eos="<|endoftext|>", stops=["<|endoftext|>", "<|user|>", "<|observation|>"],
                      answer="\n{a}<|user|>"),
    "tools_required": dict(template=TOOLS_REQUIRED, special=[], bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "arguments_as_text": dict(template=ARGUMENTS_AS_TEXT, special=[
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", answer="{a}<｜end▁of▁sentence｜>"),
    "tool_preamble": dict(template=TOOL_PREAMBLE, special=["<|begin_of_text|>", "<|start_header_id|>",
                                                           "<|end_header_id|>", "<|eot_id|>"],
                          bos="<|begin_of_text|>", eos="<|eot_id|>", answer="{a}<|eot_id|>"),
    "prefilled_think": dict(template=PREFILLED_THINK, special=[], added=["<think>", "</think>"], bos=None,
                            eos="<|im_end|>", answer="{a}<|im_end|>"),
    "arguments_concatenated": dict(template=ARGUMENTS_CONCATENATED, special=[], bos=None, eos="<|im_end|>",
                                   answer="{a}<|im_end|>"),
    "call_without_stop": dict(template=CALL_WITHOUT_STOP, special=[
        "<|developer_start|>", "<|developer_end|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
        "<|assistant_end|>", "<|tools_prefix|>", "<|tools_suffix|>"], bos=None, eos="<|assistant_end|>",
        answer="{a}<|assistant_end|>"),
    "switch_drops_reasoning": dict(template=SWITCH_DROPS_REASONING, special=[], added=["<think>", "</think>"],
                                   bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "prefill_in_last_turn": dict(template=PREFILL_IN_LAST_TURN, special=[], added=["<think>", "</think>"], bos=None,
                                 eos="<|im_end|>", answer="{a}<|im_end|>"),
    "upper_thinking_switch": dict(template=UPPER_THINKING_SWITCH, special=["<|START_THINKING|>", "<|END_THINKING|>"],
                                  bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "suffixed_think_effort": dict(template=SUFFIXED_THINK_EFFORT, special=["<think:opensource>", "</think:opensource>"],
                                  bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "thinking_switch": dict(template=THINKING_SWITCH, special=[], added=["<think>", "</think>"], bos=None,
                            eos="<|im_end|>", answer="{a}<|im_end|>"),
    # a base model's ChatML: turns end with <|im_end|>, the tokenizer's eos is <|endoftext|> (no generation config)
    "base_chatml": dict(template=CHATML_TEMPLATE, special=[], bos=None, eos="<|endoftext|>", answer="{a}<|im_end|>"),
    "plain_text": dict(template=PLAIN_TEXT, special=[], bos=None, eos="<|endoftext|>", answer=" {a}"),
    "strict_ids": dict(template=STRICT_IDS, special=["[AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]"], bos=None,
                       eos="<|im_end|>", answer="{a}<|im_end|>"),
    "no_definitions": dict(template=NO_DEFINITIONS, special=[], bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "bare_definitions": dict(template=BARE_DEFINITIONS, special=[], bos=None, eos="<|im_end|>",
                             answer="{a}<|im_end|>"),
    "json_content": dict(template=JSON_CONTENT, special=[], bos=None, eos="<|im_end|>", answer="{a}<|im_end|>"),
    "no_think_prompt": dict(template=NO_THINK_PROMPT, special=[], added=["<think>", "</think>"], bos=None,
                            eos="<|im_end|>", answer="{a}<|im_end|>"),
    "ids_once_continued": dict(template=IDS_ONCE_CONTINUED, special=[], bos=None, eos="<|im_end|>",
                               answer="{a}\n<|im_end|>"),
}


def family_tokenizer(family: str):
    """The tiny tokenizer with `family`'s special tokens and chat template (a fresh copy: safe to change); a family
    of `FAMILIES` or `QUIRKS`."""
    from sft.data.chat.settings import configure_chat
    from sft.model.loading import load_tokenizer

    spec = FAMILIES.get(family) or QUIRKS[family]
    tokenizer = load_tokenizer("tiny", chat_template=spec["template"])
    tokenizer.add_tokens(spec["special"], special_tokens=True)
    tokenizer.add_tokens(spec.get("added", []))
    if spec["bos"]:
        tokenizer.bos_token = spec["bos"]
    tokenizer.eos_token = spec["eos"]
    # the family's stop tokens: its generation config's where given, else its eos alone
    return configure_chat(tokenizer, stop_tokens=spec.get("stops"))
