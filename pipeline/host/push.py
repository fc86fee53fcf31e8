"""Push the built image to a registry the cluster pulls from, and record its digest.

`python -m pipeline push --registry <registry>/<repo>` tags the local image (default: this lock's
qwen3-pipeline:lock-<hash>) as <registry>/<repo>:lock-<hash>, pushes it through the Docker SDK with
each layer's progress shown, and records <registry>/<repo>@sha256:<digest> (pipeline/launch/pushed.py),
which `make launch-slurm` / `launch-eks` then put in the launch files. Logging in is the user's docker
credentials' business (`docker login`, a credential helper such as ECR's); nothing here handles secrets.
"""

from __future__ import annotations

import re
import sys

from pipeline.errors import PipelineError

# A registry host (with a dot or a port, or localhost) then a repository path, no tag or digest.
REGISTRY_REPO = re.compile(r"^(localhost|[^/\s]+[.:][^/\s]+)(/[a-z0-9]+([._-][a-z0-9]+)*)+$")
AUTH_WORDS = ("unauthorized", "authentication required", "no basic auth credentials", "denied")


def check_registry(registry: str) -> str:
    registry = (registry or "").strip().rstrip("/")
    if not REGISTRY_REPO.match(registry):
        raise PipelineError(f"REGISTRY={registry!r} is not <registry host>/<repository> (lowercase, no tag).",
                            "give e.g. REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com/qwen3 or "
                            "REGISTRY=127.0.0.1:5000/qwen3.")
    return registry


class Progress:
    """Docker's push events as one line per layer and state change (bytes while uploading)."""

    def __init__(self, out=sys.stdout):
        self.out, self.last = out, {}

    def show(self, event: dict) -> None:
        layer, status = event.get("id"), event.get("status")
        if not status:
            return
        detail = event.get("progressDetail") or {}
        line = status
        if detail.get("total"):
            line += f" {detail.get('current', 0) / 2**20:.1f}/{detail['total'] / 2**20:.1f} MiB"
            # one line per 10% of a layer's upload, not one per chunk
            bucket = (status, int(10 * detail.get("current", 0) / detail["total"]))
        else:
            bucket = (status, None)
        if layer and self.last.get(layer) == bucket:
            return
        if layer:
            self.last[layer] = bucket
        self.out.write(f"  {layer + ': ' if layer else ''}{line}\n")
        self.out.flush()


def push(engine, local: str, registry: str) -> str:
    """Push `local` as registry:<its tag>; the pushed reference pinned by digest."""
    import docker

    try:
        image = engine.images.get(local)
    except docker.errors.ImageNotFound as err:
        raise PipelineError(f"image {local!r} is not in the Docker engine.", "build it first: `make image`.") from err
    tag = local.rsplit(":", 1)[1] if ":" in local.rsplit("/", 1)[-1] else "latest"
    image.tag(registry, tag)
    print(f"pushing {local} as {registry}:{tag}", flush=True)
    progress, digest = Progress(), None
    for event in engine.api.push(registry, tag=tag, stream=True, decode=True):
        if "error" in event:
            message = event["error"].strip()
            fix = (f"log in to the registry with your docker credentials (`docker login {registry.split('/')[0]}`; "
                   "ECR: `aws ecr get-login-password | docker login --username AWS --password-stdin <registry>`)"
                   if any(word in message.lower() for word in AUTH_WORDS) else "read the push output above.")
            raise PipelineError(f"push of {registry}:{tag} failed: {message}", fix + ".")
        progress.show(event)
        digest = (event.get("aux") or {}).get("Digest", digest)
    if not digest:
        raise PipelineError(f"the registry did not return a digest for {registry}:{tag}.", "push again.")
    return f"{registry}@{digest}"


