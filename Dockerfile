# The pipeline image: the Neuron SDK 2.33 PyTorch training DLC (TorchNeuron, native PyTorch
# 2.14) plus what requirements.lock adds to the base's own packages (docker/wheelhouse.py: the base
# keeps its versions, differences are printed and recorded), installed from a hash-checked
# wheelhouse, running as a non-root user. Built by `make image` (pipeline/host/image.py), which makes the wheelhouse inside the base
# image, adds its records to the build context as wheels/ and serves the wheels to the build (WHEELS_URL).
#
# BASE_IMAGE: UNCONFIRMED. The tag follows AWS's Neuron DLC naming for SDK 2.33 (tags ending
# -neuronx-py314-sdk2.33.0-ubuntu26.04, awsdocs-neuron v2.33.0 setup/pytorch/dlc), but the repository
# `pytorch-training-neuronx` was last published at 2.31 and the 2.33 "PyTorch Training (TorchNeuron)"
# DLC's repository name is in no source read where this was written (docs/trn2.md). So `make image`
# inspects or pulls the base before anything else and stops in one line, saying how to look the name
# up, when it does not exist; the digest it resolved to is recorded below (org.opencontainers.image.base.digest).
# This default is configs/base-image.toml's reference; `make image` passes that reference pinned by the
# digest `make pin` recorded there (or BASE_IMAGE=<repository>@sha256:<digest>). Tests build on locally made bases.
ARG BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:2.14.0-neuronx-py314-sdk2.33.0-ubuntu26.04

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG PYTHON=python3
# Where `make image` serves the wheelhouse while it builds (pipeline/host/image.py: an HTTP server on the
# host's loopback, the build's RUN steps on the host network). The wheels never enter the build context or a
# layer: copied in, a 3.1 GB wheelhouse took ~30 GB of disk at the build's peak and ~17 GB after it (a COPY
# layer, an install stage and its copy into a second stage); served, the image is the venv's one layer.
ARG WHEELS_URL
# What BASE_IMAGE resolved to when `make image` inspected it (pipeline/host/image.py): the registry's
# manifest digest when the base was pulled, the local image id otherwise.
ARG BASE_DIGEST=unknown
ARG BASE_IMAGE_ID=unknown
ARG LOCK_SHA256=unknown
ARG PIPELINE_UID=1000
LABEL org.opencontainers.image.title="qwen3-pipeline" \
      org.opencontainers.image.description="Qwen3 training with torchtitan on trn2 (python -m pipeline)" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      pipeline.base.id="${BASE_IMAGE_ID}" \
      pipeline.lock.sha256="${LOCK_SHA256}" \
      pipeline.neuron.sdk="2.33" \
      pipeline.torch="2.14"
SHELL ["/bin/sh", "-eu", "-c"]
# What the build derived from the base (docker/wheelhouse.py): the hashed list it installs, every package
# the image holds, how it differs from the lock, the lock.
COPY wheels/ /opt/pipeline/record/
# The venv sees the base's own packages through site.addsitedir (also when the base's Python is itself a
# venv, and with the .pth files of editable installs such as torchtitan-neuron's processed): torch,
# torch-neuronx, neuronx-cc and torchtitan stay the base image's. The hashed list holds what the base
# lacks, the full closure, hence --no-deps.
RUN ${PYTHON} -m venv /opt/pipeline-venv \
    && ${PYTHON} -c 'import site; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))' \
       > "$(/opt/pipeline-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base-image.pth" \
    && /opt/pipeline-venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check --no-index \
       --find-links "${WHEELS_URL}" --require-hashes --no-deps -r /opt/pipeline/record/requirements.hashed.txt
# /checkpoints, /hf-cache and TorchNeuron's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR, torch/reference/env-vars)
# are bind mounts at run time; they exist (and belong to the user) so a run without a mount still works.
# Ubuntu 23.04 and later (the DLCs are built FROM Ubuntu 24.04/26.04) already have user `ubuntu` at UID
# 1000, where `useradd --uid 1000` fails: the UID's existing user is the image's user, and `pipeline` is
# created only when no user has that UID. Ownership is by number, so either works.
RUN if ! id -u "${PIPELINE_UID}" >/dev/null 2>&1; then \
        useradd --create-home --uid "${PIPELINE_UID}" --user-group --shell /bin/sh pipeline; \
    fi \
    && gid="$(id -g "${PIPELINE_UID}")" \
    && mkdir -p /home/pipeline /checkpoints /hf-cache /var/tmp/neuron-compile-cache \
    && chown "${PIPELINE_UID}:${gid}" /home/pipeline /checkpoints /hf-cache /var/tmp/neuron-compile-cache \
    && chmod 1777 /home/pipeline
COPY docker/entrypoint.sh /usr/local/bin/pipeline-entrypoint
COPY Makefile requirements.lock requirements-dev.lock /opt/pipeline/
COPY make/ /opt/pipeline/make/
COPY configs/ /opt/pipeline/configs/
COPY pipeline/ /opt/pipeline/pipeline/
# HOME is world-writable so `docker run --user <host uid>` (files on the mounts owned by the
# caller) works without a passwd entry.
ENV PATH=/opt/pipeline-venv/bin:${PATH} \
    HOME=/home/pipeline \
    PIPELINE_CHECKPOINTS=/checkpoints \
    HF_HOME=/hf-cache \
    TORCH_NEURONX_NEFF_CACHE_DIR=/var/tmp/neuron-compile-cache \
    PYTHONUNBUFFERED=1
USER ${PIPELINE_UID}
WORKDIR /opt/pipeline
ENTRYPOINT ["/usr/local/bin/pipeline-entrypoint"]
CMD ["doctor"]
# Last: the revision changes with every commit, and a changed layer invalidates every step after
# it, the multi-GB venv copy included.
ARG PIPELINE_REVISION=unknown
LABEL org.opencontainers.image.revision="${PIPELINE_REVISION}"
