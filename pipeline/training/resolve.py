"""Resolve one training run: settings, flags and the checkpoint → a validated RunSpec.

Used by the `train` stage (and its dry run) and by `launch` (multi-node files): the same
resolution and the same checks, whatever launches the ranks.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoint import hf_dir
from pipeline.checkpoint.arch import Qwen3Arch, arch_from_config
from pipeline.errors import PipelineError
from pipeline import flags
from pipeline.flags import flag
from pipeline.models import registry
from pipeline.run import settings as settings_mod
from pipeline.run import store, targets
from pipeline.run.ref import RunRef
from pipeline.run.settings import TrainSettings
from pipeline.run.spec import RunSpec
from pipeline.data import dataset
from pipeline.training import memory
from pipeline.titan import assets

HUB_CONFIGS = store.HUB_CONFIGS


@dataclass(frozen=True)
class RunRequest(RunRef):
    """What a user asks for: the run's address (RunRef: model, path, name) and how to run it; None means
    "not given" (configs decide). Fields with help are the `train` stage's flags (pipeline.flags),
    TrainSettings' flag fields come in `flags`."""

    target: str | None = flag(None, "cpu, cuda or trn2 (train: detected when unset; launch: trn2)", make="TARGET",
                              make_default="detected")
    config: Path | None = flag(None, "your config file, layered over configs/<target>.toml key by key", make="CONFIG")
    revision: str | None = flag(None, "the Hub revision the run must start from (as downloaded)", make="REVISION",
                                make_default="configs/models.toml")
    titan_args: tuple[str, ...] = flag((), "torchtitan flags applied over the built config, e.g. "
                                       "--titan-args='--training.steps 5 --lr-scheduler.warmup-steps 1' ('--help' lists "
                                       "them)", words=True, make="TITAN_ARGS",
                                       make_help="torchtitan flags applied over the built config, e.g. "
                                       "TITAN_ARGS=\"--training.steps 5 --lr-scheduler.warmup-steps 1\" (--help lists them)")
    dry_run: bool = flag(False, "resolve and print the run (train: and its torchrun command; launch: and its files); "
                         "launch and write nothing", make="DRY_RUN",
                         make_help="train, launch: resolve and print the run (and its torchrun command, its launch "
                         "files), launch and write nothing; publish: list what would be uploaded, no network")
    fresh: bool = flag(False, "discard this run (checkpoints, metrics, export, verify.json) and start it again",
                       make="FRESH")
    force: bool = flag(False, "launch on CPU even when the ranks' memory estimate is more than this host has "
                              "(a warning instead of the refusal)", make="FORCE",
                       make_help="1: replace an existing download or export; train: launch past the host-memory "
                                 "check (CPU)")
    flags: dict = field(default_factory=dict)  # TrainSettings fields given on the command line (STEPS=…)
    checkpoints_root: Path | None = None  # where the nodes see checkpoints/ (launch); default this host's
    settings: TrainSettings | None = None  # given whole (rehearse): no config file is read, flags still apply
    directory: Path | None = None  # the run's folder when not runs/<name> (rehearse; launch --run-dir)

    @classmethod
    def from_args(cls, args) -> RunRequest:
        """The request a stage's parsed flags (add_flags of RunRequest and of TrainSettings) ask for."""
        return cls(**flags.values(cls, args), flags=flags.values(TrainSettings, args, given_only=True))


def resolve(request: RunRequest) -> RunSpec:
    path = registry.get(request.path)
    target = targets.resolve(request.target)
    cfg = request.settings or settings_mod.load(target.name, path.name, registry.names(), request.config)
    cfg = settings_mod.with_flags(cfg, **request.flags)
    home = store.home(request.model, request.checkpoints_root)
    store.check_revision_applies(home.source, request.revision)
    if request.dry_run and not home.is_downloaded():
        arch, source_dir = arch_without_download(home.source), home.local_source
    else:
        source_dir = home.source_dir(request.revision)
        arch = hf_dir.validate(source_dir).arch
    data = dataset.resolve(cfg.dataset, home.data_file, check_local=not request.dry_run, model=request.model,
                           root=home.root)
    eval_file = dataset.eval_file(cfg, data, home.data_file, check_local=not request.dry_run)
    if not request.dry_run:
        assets.tokenizer_dir(cfg.tokenizer, str(source_dir))  # found before any rank starts
    spec = RunSpec(
        model=request.model, model_key=home.source.key, path=path.name, target=target.name,
        source_dir=str(source_dir), run_dir=str(request.directory or request.run_dir(home.root).path), arch=arch, settings=cfg,
        data_kind=data.kind, data_file=data.file, data_format=data.format, eval_file=eval_file,
        peak_flops_per_rank=target.peak_flops_per_rank(cfg.lnc),
        overrides=list(path.overrides(target.name, cfg)), titan_args=list(request.titan_args),
    )
    if spec.titan_args:
        check_titan_args(spec)
    check_parallelism(spec)
    check_positions(spec)
    dataset.check_documents(data, cfg.world_size // cfg.tensor_parallel)
    if spec.eval_file:  # the validator splits the held-out file between the same ranks
        dataset.check_documents(dataset.DataSource("file", spec.eval_file, spec.eval_file, data.format),
                                cfg.world_size // cfg.tensor_parallel)
    check_device_choices(spec)
    check_wandb(spec)
    check_lora(spec)
    check_preference(spec)
    dpo = spec.data_format == "preference"
    spec.settings, chosen = memory.fit(spec.arch, spec.settings, spec.path, spec.target, dpo)
    if chosen:  # a plan that fits instead of the configured one, said where the dry run shows it
        print(f"note: {chosen}", file=sys.stderr, flush=True)
    if path.prepare is not None:
        path.prepare(spec, request.dry_run)  # the path's own rules (kernel constraints) first: they name the fix
    spec.memory = memory.check(spec.arch, spec.settings, spec.path, spec.target, dpo).to_dict()
    return spec


def check_titan_args(spec: RunSpec) -> None:
    """TITAN_ARGS parsed over the very config the ranks will build, before any rank starts and before
    the checks: what they change of the pipeline's own settings is folded into spec.settings (so the
    checks and the estimate see the plan that runs) or refused (pipeline.training.titan_flags). This
    imports torchtitan into the launcher, which only a run with TITAN_ARGS pays for."""
    from pipeline.training import titan_flags

    before = spec.settings
    spec.settings = titan_flags.fold(spec)
    note = titan_flags.summary(before, spec.settings)
    if note:
        print(f"note: {note}", file=sys.stderr, flush=True)


def arch_without_download(source: store.Source) -> Qwen3Arch:
    """Dry runs work before download: embedded configs are known, and so are the Hub configs in
    configs/hub_configs (the real config.json files)."""
    if source.kind == "embedded":
        from pipeline.checkpoint.embedded import EMBEDDED

        return arch_from_config(EMBEDDED[source.model].config, f"embedded {source.model}")
    known = HUB_CONFIGS / f"{source.name}.json"
    if known.exists():
        return arch_from_config(json.loads(known.read_text()), str(known))
    raise PipelineError(f"{source.model!r} is not downloaded and its config.json is not in {HUB_CONFIGS}.",
                        f"run `make download MODEL={source.model}` first.")


def check_parallelism(spec: RunSpec) -> None:
    """TP/SP/FSDP degrees that the world size and the model's heads allow."""
    s, arch = spec.settings, spec.arch
    world, tp = s.world_size, s.tensor_parallel
    if world % tp:
        raise PipelineError(f"tensor_parallel={tp} does not divide the {world} ranks.", "choose a divisor of the world size.")
    if arch.num_key_value_heads % tp or arch.num_attention_heads % tp:
        raise PipelineError(f"tensor_parallel={tp} does not divide the heads ({arch.num_attention_heads}/"
                            f"{arch.num_key_value_heads} kv).", "choose a TP degree that divides the kv heads.")
    if s.sequence_parallel and s.seq_len % tp:
        raise PipelineError(f"seq_len={s.seq_len} is not divisible by tensor_parallel={tp} (sequence parallelism).",
                            f"use a multiple of {tp}.")
    if s.data_parallel_shard != -1 and s.data_parallel_shard * tp != world:
        raise PipelineError(f"data_parallel_shard={s.data_parallel_shard} × tensor_parallel={tp} ≠ {world} ranks.",
                            "set data_parallel_shard = -1 to use every remaining rank.")



def check_lora(spec: RunSpec) -> None:
    """Each path makes adapters its own way (registry.LoraSupport); its targets are checked here, before launch."""
    s = spec.settings
    if s.lora_rank < 0 or (s.lora_rank and s.lora_alpha <= 0):
        raise PipelineError(f"lora_rank = {s.lora_rank}, lora_alpha = {s.lora_alpha}: rank must be ≥ 0 (0: off) "
                            "and alpha > 0.", "fix them in your config.")
    if not s.lora_rank:
        return
    support = registry.get(spec.path).lora
    if support is None:
        able = [p for p in registry.names() if registry.get(p).lora]
        raise PipelineError(f"LoRA (lora_rank > 0) runs on the {', '.join(able)} paths; the {spec.path} path has "
                            "no way to make adapters.", f"use `make train-{able[0]}`, or lora_rank = 0.")
    support.targets(s, spec.arch)


def check_preference(spec: RunSpec) -> None:
    """DPO (preference data): every pair well-formed, β > 0, and the torchtitan API its loader and step are written for (0.3.0's: a
    batch of [rows, seq_len]; main folds the batch into one packed row, #4121)."""
    if spec.data_format != "preference":
        return
    s = spec.settings
    for file in (spec.data_file, spec.eval_file):  # every pair, before any rank starts (an equal pair is refused)
        if file and Path(file).is_file():
            dataset.check_readable(dataset.DataSource("file", file, file, "preference"))
    if s.dpo_beta <= 0:
        raise PipelineError(f"dpo_beta = {s.dpo_beta}: DPO's β must be > 0.", "set dpo_beta > 0 (TRL's default: 0.1).")


def check_wandb(spec: RunSpec) -> None:
    """wandb = true needs the wandb package where the ranks run (torchtitan would only log an error)."""
    import importlib.util

    if spec.settings.wandb and importlib.util.find_spec("wandb") is None:
        raise PipelineError("wandb = true but the wandb package is not installed.",
                            "pip install wandb (or set wandb = false).")


def check_positions(spec: RunSpec) -> None:
    """RoPE and the model are built for max_position_embeddings: a longer sequence is not this model."""
    seq_len, limit = spec.settings.seq_len, spec.arch.max_position_embeddings
    if seq_len > limit:
        raise PipelineError(f"SEQ_LEN={seq_len} is beyond the model's max_position_embeddings ({limit}, its "
                            "config.json).", f"give SEQ_LEN ≤ {limit}.")


def check_device_choices(spec: RunSpec) -> None:
    """Compile and attention settings the target's device can run (configs/trn2.toml says why)."""
    s = spec.settings
    if spec.target != "trn2":
        return
    if s.attention_backend == "flex" and registry.get(spec.path).titan_attention:
        raise PipelineError('attention_backend = "flex" on trn2: torchtitan runs FlexAttention and its block mask '
                            "through torch.compile with Inductor, which the neuron backend does not use.",
                            'set attention_backend = "document_sdpa" (configs/trn2.toml does).')
    if s.compile and s.compile_backend != "neuron":
        raise PipelineError(f"compile_backend = {s.compile_backend!r} on trn2: only the neuron backend compiles for "
                            "Trainium.", 'set compile_backend = "neuron", or compile = false (eager).')
    if s.compile:
        print("warning: torch.compile on trn2 with FSDP2 (fully_shard): AWS recommends SimpleFSDP and nki_op-wrapped "
              "kernels for compiled runs (torch/guides/torch-distributed), which this pipeline does not use; "
              "configs/trn2.toml runs eager.", file=sys.stderr, flush=True)
