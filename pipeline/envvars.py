"""The environment variables the pipeline itself reads or sets, by name, in one place (the trn2 runtime's
own, NEURON_*/TORCH_NEURONX_*, live with their facts in pipeline.run.targets). Every PIPELINE_* name in
the repository is one of these (tests/project/test_project_envvars.py)."""

CHECKPOINTS = "PIPELINE_CHECKPOINTS"  # the checkpoints root (default: <repo>/checkpoints)
IMAGE = "PIPELINE_IMAGE"  # the image IN_CONTAINER runs the stages in
# Set (to 1) where a run must be reproducible, e.g. the trn2 CI workflow: a Hub revision that is not a
# commit (a branch such as "main" moves) is then refused instead of warned about.
REQUIRE_PINNED = "PIPELINE_REQUIRE_PINNED"
LAUNCHED_AT = "PIPELINE_LAUNCHED_AT"  # when the launcher started torchrun (time.time()), for timings.json
# `image --run`: the host's persistent Neuron compile cache mounted into the container (default
# ~/.cache/neuron-compile-cache); the trn2 workflow points it at the runner's.
COMPILE_CACHE = "PIPELINE_COMPILE_CACHE"
NKI_OP_COUNTS = "PIPELINE_NKI_OP_COUNTS"  # a directory: each rank writes how often each NKI op ran (tests)
TARGET = "TARGET"  # cpu, cuda or trn2 (detected when unset)
HF_TOKEN = "HF_TOKEN"  # a secret: read from the environment, never printed or written to a file
# Hugging Face settings that choose the cache and endpoint: passed to every place a run goes.
HF_SETTINGS = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")

# The Dockerfile's build arguments (not environment variables of a stage): the image user's uid and the
# repository's git revision, its org.opencontainers.image.revision label.
BUILD_UID = "PIPELINE_UID"
BUILD_REVISION = "PIPELINE_REVISION"

# The test suite's own (tests/): an embedded-models checkpoints root made once and only read; 1 runs the
# container tests (they need root to start dockerd); where the container tests write their measurements.
TEST_CHECKPOINTS = "PIPELINE_TEST_CHECKPOINTS"
CONTAINER_TESTS = "PIPELINE_CONTAINER_TESTS"
MEASURE_DIR = "PIPELINE_MEASURE_DIR"
# The key file of the keyed DCP digests (pipeline.run.digest_key; default under $XDG_CONFIG_HOME or ~/.config):
# outside the checkpoints root, and the same file for every node of a run.
DIGEST_KEY = "PIPELINE_DIGEST_KEY"
VERBOSE = "PIPELINE_VERBOSE"  # 1 (Make's VERBOSE=1): every line of the ranks and stages, unfiltered (pipeline.console)
BRIEF = "PIPELINE_BRIEF"  # 1 (set by `make pipeline`): a stage says its outcome in one line; the end table has the rest
