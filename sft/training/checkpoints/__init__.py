"""Checkpoints: written complete or not at all, verified, found and rotated (`store`), sharded under FSDP2
(`sharded`), the trainer's saving overrides (`saving`) and the memory a save takes (`memory_peak`), what a resume may
change (`resume`), and the run dir that holds them, its lock and whose run it is (`run_dir`).

May import: `config base`, `sft.data`, `sft.loss`, `sft.model`, `sft.eval`, `sft.training.compat`, `sft.training.processes`."""
