"""What a finished run yields: its export as a Hugging Face checkpoint with its model card, the
verification of that export against the source and the run, and the report of a model's runs (stages
export, verify, report)."""
