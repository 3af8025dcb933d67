"""The training stage: `WeightedLossTrainer` (`trainer`), the `TrainingArguments` it runs with (`arguments`,
`trainer_fields`), and its rooms, each a package of one concept, lowest first (a room imports only rooms before it,
`tests/test_layout.py` holds it):

- the base: every write to another library's private attribute (`compat`), the callback base (`callbacks`);
- `processes/`: how many processes run and on what (distributed set-up, the engines, sequence parallelism, bf16 on a
  CPU, a rank's refusal said once, the sentinel that tidies after a killed process);
- `checkpoints/`: complete-or-invisible checkpoints, sharded ones, saving, what a resume may change, the run dir;
- `observability/`: what a run shows (the console's lines, `metrics.jsonl`, throughput, the stack's noise kept out,
  what a failed run says);
- `controllers/`: Trainer callbacks with checkpointed state (the guard, early stopping, a curriculum, ...);
- `step/`: a step's control (its fate, clip policies, preemption).

`trainer` and `arguments` sit on top: they put the rooms together."""
