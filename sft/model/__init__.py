"""The model stage: tokenizer and causal LM loading, the embedded tiny model (`loading`), LoRA through PEFT
(`lora`), attention over packed rows (`attention`) and merging an adapter into its base (`merge`)."""
