"""Records with no torch in them: settings, targets, the resolved run (run.json), a run directory's
files, and where a model's source, data and runs live under checkpoints/."""
