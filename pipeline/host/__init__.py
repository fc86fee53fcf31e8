"""The machine around the runs: what the host has (doctor), the container image the stages run in,
and its push to a registry (stages doctor, image, push)."""
