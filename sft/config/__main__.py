"""`python -m sft.config`: write `sft/training/trainer_fields.py` for the installed transformers."""

from pathlib import Path

import sft.training
from sft.training.arguments import trainer_fields_source

target = Path(sft.training.__file__).with_name("trainer_fields.py")
target.write_text(trainer_fields_source())
print(f"wrote {target}")
