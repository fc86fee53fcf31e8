"""Records with no torch in them: settings, targets, the resolved run (run.json), a run directory's
files, where a model's source, data and runs live under checkpoints/, and how a source gets there
(`sources`, the download)."""
