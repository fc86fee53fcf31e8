"""The environment variables the pipeline itself reads or sets, by name, in one place (the trn2 runtime's
own, NEURON_*/TORCH_NEURONX_*, live with their facts in pipeline.run.targets)."""

CHECKPOINTS = "PIPELINE_CHECKPOINTS"  # the checkpoints root (default: <repo>/checkpoints)
IMAGE = "PIPELINE_IMAGE"  # the image IN_CONTAINER runs the stages in
# Set (to 1) where a run must be reproducible, e.g. the trn2 CI workflow: a Hub revision that is not a
# commit (a branch such as "main" moves) is then refused instead of warned about.
REQUIRE_PINNED = "PIPELINE_REQUIRE_PINNED"
LAUNCHED_AT = "PIPELINE_LAUNCHED_AT"  # when the launcher started torchrun (time.time()), for timings.json
TARGET = "TARGET"  # cpu, cuda or trn2 (detected when unset)
HF_TOKEN = "HF_TOKEN"  # a secret: read from the environment, never printed or written to a file
# Hugging Face settings that choose the cache and endpoint: passed to every place a run goes.
HF_SETTINGS = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")
