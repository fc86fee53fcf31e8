"""Qwen3 on Trainium2 with torchtitan, as a pipeline of stages (`python -m pipeline <stage>`).

The flow: download → data → train → export / verify → report (publish, rehearse beside them).
Packages, each importing only what it builds on (docs/design.md, tests/project/test_project_import_graph.py):
  errors, fsutil,  one exception type users read; atomic writes; the dtype table; the environment
  dtypes, envvars, variables' names; command lines generated from dataclasses; the filter over the
  flags, console   ranks' output
  checkpoint/      HF checkpoint directories: architecture, validation, embedded models and their corpus,
                   manifests
  run/             records: settings, targets, the run spec, a run directory, the model store
  titan/           torchtitan glue: version/CPU patches, private internals and their check, TITAN_ARGS,
                   its test assets, the trainer's additions
  models/          the training-path registry and each path's model (native, hf, nki; the kernel check)
  data/            what a run trains on: DATASET, chat, preference pairs, the files stage data writes
  training/        resolve a run (TITAN_ARGS folded in, memory checked), the per-rank entry point, the
                   trn2 plan's rehearsal
  launch/          its torchrun command, the launcher, cluster launch files, the rehearsal's runs, the
                   image's name, pushed images, the download of a model's source
  outputs/         what a finished run yields: export and its model card, verify, report
  host/            the machine around the runs: doctor, the container image, the registry push
  stages/          one thin module per Make target: a command line over the packages above; no stage
                   imports another
"""
