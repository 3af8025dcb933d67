"""A run's summary (`sft.experiments.summary`): what changed, the best evaluation, where the model is, what comes next."""

from sft.experiments.summary import duration, summary_text

METRICS = [{"step": 0, "eval_loss": 1.25, "eval_ce": 1.2, "eval_loss_hardest_bucket": 1.5},
           {"step": 5, "loss": 1.1}, {"step": 10, "loss": 0.9},
           {"step": 10, "eval_loss": 0.75, "eval_ce": 0.7, "eval_loss_hardest_bucket": 1.1},
           {"step": 20, "eval_loss": 0.8, "eval_ce": 0.72, "eval_loss_hardest_bucket": 1.0}]


def test_a_finished_lora_run_says_first_last_best_where_and_the_next_commands():
    text = summary_text("out/run", METRICS, "finished", 20, 94.2, tokens_per_second=161.4, adapter=True,
                        model_name="smollm2", eval_rows="data/eval.jsonl")
    assert text.splitlines() == [
        "run finished: 20 steps in 1m34s, 161 tokens/s",
        "eval_loss 1.2500 -> 0.8000 (-0.4500), best 0.7500 at step 10",
        "eval_ce 1.2000 -> 0.7200 (-0.4800); hardest bucket 1.500 -> 1.000 (-0.500)",
        "adapter: out/run/model (LoRA; base model: smollm2)",
        "next:",
        "  sft compare run=out/run rows=data/eval.jsonl",
        "  sft merge checkpoint=out/run output=out/run/merged",
        "  sft recipe out/run -o recipe.yaml",
        "  sft plot out/run [<other run dirs>]   (this run's picture: out/run/curves.png)"]


def test_a_full_run_without_evaluations_names_its_model_and_the_train_loss():
    text = summary_text("r", [{"step": 5, "loss": 2.0}, {"step": 10, "loss": 1.5}], "finished", 10, 3725,
                        model_name="tiny")
    assert "run finished: 10 steps in 1h02m05s\ntrain loss 2.0000 -> 1.5000 (-0.5000) (no evaluation" in text
    assert "model: r/model\n" in text and "sft merge" not in text and "rows=<your eval chats.jsonl>" in text


def test_a_preempted_run_says_how_far_it_got_and_the_command_that_goes_on():
    text = summary_text("r", METRICS[:2], "preempted", 5, 12.34, continue_with="resume=auto ...")
    assert text == "run preempted: 5 steps in 12.3s\neval_loss 1.2500 -> 1.2500, best 1.2500 at step 0\n" \
                   "eval_ce 1.2000 -> 1.2000; hardest bucket 1.500 -> 1.500\ncontinue with: resume=auto ...\n"
    assert duration(59.94) == "59.9s" and duration(60) == "1m00s"
