"""`python -m sft.sample_data`: the bundled sample task written again from its generator (`sft.sample_data.main`)."""

from sft.sample_data import main

main()
