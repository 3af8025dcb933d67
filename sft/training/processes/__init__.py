"""Processes: how many run and on what. The launcher's environment read as torch.distributed's (SLURM's too), the
process group and what a run does at its end (`distributed`), DeepSpeed ZeRO and FSDP2 as TrainingArguments
(`engines`), each sequence split over ranks (`sequence_parallel`), bf16 on a CPU (`precision`), a rank's refusal
said once by the launcher (`rank_errors`), and the sentinel that tidies a killed process's files (`sentinel`).

May import: `config base`, `sft.data`, `sft.loss`, `sft.model`, `sft.eval`, `sft.training.compat`."""
