"""`python -m sft.bench`: the benchmark (sft/bench/run.py)."""

from sft.bench.run import main

raise SystemExit(main())
