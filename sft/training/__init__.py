"""The training stage: `WeightedLossTrainer` (`trainer`), a step's fate (`step_control`), clip policies
(`clipping`), controllers (`controllers/`), checkpoints and resume (`checkpoints`), the run dir (`run_dir`),
preemption (`preemption`), processes and the two engines (`distributed`, `engines`), TrainingArguments
(`arguments`, `trainer_fields`), throughput (`throughput`), what a failed run says (`advice`), and every write to
another library's private attribute (`compat`)."""
