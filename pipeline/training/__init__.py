"""From settings to ranks: `resolve` makes the RunSpec, `torchrun` its launch command, `entry` is
what every rank runs (RunSpec → torchtitan Trainer.Config → train)."""
