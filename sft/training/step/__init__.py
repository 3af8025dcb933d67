"""A step's control: what becomes of each optimizer step (`control`: its loss's denominator over micro-batches and
ranks, the gradient norm, the judges' verdicts, a skipped step), the clip policies (`clipping`), preemption
(`preemption`: a signal finishes the step, saves and exits 75), the fp32 copies an optimizer steps for bf16
weights (`master_weights`: `trainer.precision=pure`), and Muon with AdamW (`muon`: `trainer.optim=muon`).

May import: `config base`, `sft.data`, `sft.loss`, `sft.model`, `sft.eval`, `training base`,
`sft.training.processes`, `sft.training.checkpoints`, `sft.training.observability`, `sft.training.controllers`."""
