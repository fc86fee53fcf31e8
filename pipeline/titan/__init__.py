"""torchtitan glue, one concern per module, among them: `patches` (the CPU and trn2 runtime patches
applied in each rank before torchtitan is imported, one comment each), `internals` (every
torchtitan name, field and keyword the pipeline uses, checked before launch and by `doctor --titan`) and `accessors` (the only way the
pipeline reaches them), `args` (TITAN_ARGS through torchtitan's own parser), `api` (the two
torchtitan APIs told apart), `assets` (torchtitan's test tokenizer and c4_test, found without importing it), `model_spec` (the one place a model is described to torchtitan: ModelSpec,
Trainer.Config's model field, context length), and `trainer` (what the pipeline adds to torchtitan's Trainer:
metrics.jsonl, first batch, the last step's HF save)."""
