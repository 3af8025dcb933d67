"""The eval stage: greedy answers to eval prompts and their exact match (`generation`), and generation samples
scored and logged at evaluations (`samples`)."""
