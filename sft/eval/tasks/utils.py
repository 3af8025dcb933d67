"""What the bundled lm-evaluation-harness tasks on the sample data compute beyond the harness's own templates (this
file is read by lm-eval through the tasks' `!function` tags, beside them).

    process_docs: only the one-question chats (a follow-up turn's question, "Now add 5.", means nothing alone), each
        with `question`, `answer` (the reference: "36 + 96 = 132"), `choices` (the reference and the same equation
        with three sums a slip would give, +1, +10 and -10, in increasing order of the sum) and `gold` (the
        reference's place among them);
    byte perplexity: exp of minus the answers' summed log-likelihood over their summed UTF-8 bytes, pooled over the
        answers: a per-unit perplexity of the reference answers that does not depend on the tokenizer.
"""

import math


def process_docs(dataset):
    def one_question(doc):
        return sum(m["role"] == "user" for m in doc["messages"]) == 1

    def fields(doc):
        answer = doc["messages"][-1]["content"]
        equation, total = answer.rsplit("= ", 1)
        total = int(total)
        sums = sorted({total, total + 1, total + 10, total - 10 if total >= 10 else total + 2})
        return {"question": doc["messages"][-2]["content"], "answer": answer,
                "choices": [f"{equation}= {s}" for s in sums], "gold": sums.index(total)}

    return dataset.filter(one_question).map(fields)


def byte_perplexity_item(doc, results):
    (log_likelihood, _greedy), = results
    return {"byte_perplexity": (log_likelihood, len(doc["answer"].encode("utf-8")))}


def pooled_byte_perplexity(items):
    return math.exp(-sum(ll for ll, _ in items) / sum(n for _, n in items))
