"""A conversation rendered with the model's chat template, and where each trained answer lies in it: the renderer and
what it probes of the template (`template`), the kwargs and stop tokens a tokenizer is given (`settings`), string work
on renderings (`text`), reasoning blocks and their switches (`reasoning`), the ways out a refusal offers, each tried
first (`remedies`), and the answers' character spans, tool calls included (`turns`).

    chat_views(renderer, messages, tools, labelling)  ->  [Views(text, spans of each answer through its stop token)]

A fix to a template rule lands here and nowhere else; the tokens are the `tokens` room's.

May import: `config base`, `sft.data.spec`."""
