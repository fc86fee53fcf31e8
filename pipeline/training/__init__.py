"""From data to ranks: the data files (`data_files`), `resolve` makes the RunSpec, `torchrun` its launch
command, `launcher` runs it under the run's lock, `entry` is what every rank runs (RunSpec → torchtitan
Trainer.Config → train); `cluster` renders the same run for Slurm and EKS, `rehearsal` and `rehearsal_runs`
rehearse the trn2 plan on CPU ranks."""
