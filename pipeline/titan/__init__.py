"""torchtitan glue: `compat` (every version and CPU workaround, one comment each) and `trainer`
(what the pipeline adds to torchtitan's Trainer: metrics.jsonl, first batch, weights copy)."""
