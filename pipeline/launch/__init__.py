"""Getting a resolved run onto machines: the torchrun command (`torchrun`), the local launch under the
run's lock (`launcher`), the Slurm and EKS files that run the same command on a cluster (`cluster`),
the rehearsal's runs and two-"node" launch (`rehearsal_runs`), and what those machines need in place:
the image's name and lock (`image`), the registry digest `make push` recorded (`pushed`) and the model's
source checkpoint in the store (`sources`, the download)."""
