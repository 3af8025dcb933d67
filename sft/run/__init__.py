"""A training run: `build` (what a run is made of, `sft.run.build`), `train` (the recipe top to bottom,
`sft.run.train`), and its end (`sft.run.finish`). The commands (`sft.commands.train`) start it from a config."""
