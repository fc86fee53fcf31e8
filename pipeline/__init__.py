"""Qwen3 on Trainium2 with torchtitan, as a pipeline of stages (`python -m pipeline <stage>`).

Layers, each importing only the ones before it:
  errors, fsutil   one exception type users read; atomic writes
  checkpoint/      HF checkpoint directories: architecture, validation, embedded models, manifests
  run/             records: settings, targets, the run spec, a run directory, the model store
  titan/           torchtitan glue: version/CPU compatibility, the trainer's additions
  models/          the training-path registry and each path's model (native, hf, nki)
  training/        resolve a run, build its torchrun command, the per-rank entry point
  stages/          one module per Make target
"""
