"""`python -m sft.bench`: what this project's control costs against a plain Trainer and TRL (`run`, the driver;
`cases`, one case per process; `config`, the `bench` node; `baseline`, sft 0.1's labelling)."""
