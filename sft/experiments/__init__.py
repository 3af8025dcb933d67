"""The experiments stage: what a run reports (`results`), the trackers (`tracking`), sweep jobs (`sweep`), and the
sweep report with its statistics (`report`, `stats`)."""
