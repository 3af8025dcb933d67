"""What a run shows: the console's short lines and `metrics.jsonl` (`step_log`, `metrics_file`), tokens per second
and MFU (`throughput`), the stack's warnings that ask nothing of the user kept out (`noise`), and what a failed or
stopped run says, with the checkpoint to continue from (`advice`).

May import: `config base`, `sft.data`, `sft.loss`, `sft.model`, `sft.eval`, `training base`,
`sft.training.processes`, `sft.training.checkpoints`."""
