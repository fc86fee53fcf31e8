"""A run resolved and trained: `resolve` makes the RunSpec from settings, flags and the checkpoint
(TITAN_ARGS folded in by `titan_flags`, memory checked by `memory`), `entry` is what every rank runs
(RunSpec → torchtitan Trainer.Config → train), and `rehearsal` resolves the trn2 plan rehearsed on CPU
ranks. Data is pipeline.data's; starting the ranks is pipeline.launch's."""
