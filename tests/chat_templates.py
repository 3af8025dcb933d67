"""Chat templates of the major model families, written for the tests in the style of each family's
published template (same framing, special tokens and rewriting rules), on the tiny BPE vocabulary.

Each family: its template, its special tokens, bos/eos, and how an assistant answer `a` is trained
(`answer`: the text of its trained tokens; the chat's last answer may end differently, `last_answer`).
"""

from sft.model import CHATML_TEMPLATE

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
    "phi3": dict(template=PHI3, special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|eos|>"],
                 bos=None, eos="<|eos|>", answer="{a}<|end|>", last_answer="{a}<|end|>\n<|eos|>"),
}


def family_tokenizer(family: str):
    """The tiny tokenizer with `family`'s special tokens and chat template (a fresh copy: safe to change)."""
    from sft.model import load_tokenizer

    spec = FAMILIES[family]
    tokenizer = load_tokenizer("tiny", chat_template=spec["template"])
    tokenizer.add_tokens(spec["special"], special_tokens=True)
    tokenizer.add_tokens(spec.get("added", []))
    if spec["bos"]:
        tokenizer.bos_token = spec["bos"]
    tokenizer.eos_token = spec["eos"]
    return tokenizer
