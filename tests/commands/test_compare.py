"""`sft compare`: the table of answers before and after, and one line for a run dir that is none."""

import subprocess
import sys

from conftest import chat

from sft.commands.compare import Answers, table


def test_the_table_holds_each_answer_beside_its_reference_and_the_totals():
    rows = [chat("Who are you?", "Quill."), chat("2 | 3?", "5")]
    text = table(rows, Answers(["SmolLM.", "5"], [True, False]), Answers(["Quill.", " 5\n"], [True, True]))
    assert "| Who are you? | Quill. | SmolLM. | Quill. |" in text
    assert "| 2 \\| 3? | 5 | 5 |  5⏎  |" in text  # a cell's | and line breaks kept visible, in their place
    assert text.endswith("exact match: before 1/2, after 2/2; ended at a stop token: before 1/2, after 2/2\n")


def test_a_dir_that_is_no_run_is_one_line_and_exit_2(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n')
    proc = subprocess.run([sys.executable, "-m", "sft", "compare", f"run={tmp_path}", f"rows={rows}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path}: no .hydra/config.yaml here: run= is a run dir of sft.train\n")
