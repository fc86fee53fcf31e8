"""Qwen3 on Trainium2 with torchtitan, as a pipeline of stages (`python -m pipeline <stage>`).

The flow: download → data → train → export / verify → report (publish, rehearse beside them).
Layers, each importing only the ones before it:
  errors, fsutil,  one exception type users read; atomic writes; the dtype table; the environment
  dtypes, envvars, variables' names; command lines generated from dataclasses
  flags
  checkpoint/      HF checkpoint directories: architecture, validation, embedded models, manifests
  run/             records: settings, targets, the run spec, a run directory, the model store and
                   how a source gets into it (sources: the download)
  titan/           torchtitan glue: version/CPU patches, private internals and their check, TITAN_ARGS,
                   the trainer's additions
  models/          the training-path registry and each path's model (native, hf, nki; the kernel check)
  training/        data files, resolve a run, its torchrun command, the launcher, the per-rank entry point,
                   cluster launch files, the trn2 plan's rehearsal
  outputs/         what a finished run yields: export, verify, report
  host/            the machine around the runs: doctor, the container image, the registry push
  stages/          one thin module per Make target: a command line over the packages above; no stage
                   imports another (tests/project/test_project_import_graph.py)
"""
