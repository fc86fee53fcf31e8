"""Direct Preference Optimization inside torchtitan's trainer (https://arxiv.org/abs/2305.18290), as TRL 1.16's
DPOTrainer computes it (trl/trainer/dpo_trainer.py, `_compute_loss`): each completion's log-probability summed
over its tokens, the log-ratios of policy and reference, and

  sigmoid  -log σ(β · (Δchosen − Δrejected))
  ipo      ((Δchosen / chosen tokens − Δrejected / rejected tokens) − 1/(2β))²
  hinge    relu(1 − β · (Δchosen − Δrejected))

averaged over the pairs of the global batch; rewards/chosen = β·Δchosen, rewards/rejected = β·Δrejected,
their margin and how often chosen's is larger (rewards/accuracies), under TRL's metric names.

The reference is the run's starting weights, frozen. Full fine-tuning keeps one copy of each rank's
parameter shards (what the memory estimate counts as "reference model") and runs the reference forward
on the policy's own modules with those shards swapped in, in place: FSDP all-gathers from the same
storage and TP keeps its layout, so the reference runs every parallel plan the policy runs. With LoRA the
reference is the base with the adapters off (their B matrices zero for the reference forward): no second
copy of the model (TRL with PEFT: `use_adapter(model, None)`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.components.validate import Validator
from torchtitan.tools.logging import logger

from pipeline.titan import api
from pipeline.titan.trainer import PipelineTrainer

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX
# The per-step sums reduced over the data-parallel ranks (one all-reduce per microbatch).
SUMS = ("pairs", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected", "completion_logp", "completion_tokens")


def token_nll(pred: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each token's cross-entropy ([N, V] logits, [N] labels; 0 where ignored), as torchtitan's loss computes it but
    unreduced: under TP the lm_head hands each rank its vocabulary shard (a DTensor on Shard(-1), or the local shard
    under torchtitan's spmd_types backend), and torchtitan's loss-parallel cross-entropy makes it exact."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
    from torchtitan.distributed.utils import get_spmd_backend

    from pipeline.titan import accessors

    if isinstance(pred, DTensor) and pred.placements == (Shard(pred.ndim - 1),):
        return accessors.vocab_parallel_token_nll(pred.to_local(), labels, pred.device_mesh.get_group(), pred.shape[-1])
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        return accessors.vocab_parallel_token_nll(pred, labels, current_spmd_mesh().get_group("tp"), vocab_size)
    return F.cross_entropy(pred.float(), labels, reduction="none", ignore_index=IGNORE_INDEX)


def sequence_logps(pred: torch.Tensor, labels: torch.Tensor, row_len: int,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of the label tokens per row, label tokens per row) of rows of `row_len` tokens:
    [rows, row_len] batches (torchtitan 0.3.0) or the same rows folded end to end into [T] (main)."""
    per_token = token_nll(pred.reshape(-1, pred.shape[-1]), labels.reshape(-1), vocab_size)
    return -per_token.view(-1, row_len).sum(dim=1), (labels.reshape(-1, row_len) != IGNORE_INDEX).sum(dim=1)


def dpo_losses(logps: torch.Tensor, ref_logps: torch.Tensor, tokens: torch.Tensor, beta: float,
               loss_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen log-ratio, rejected log-ratio) of rows [chosen…, rejected…]."""
    chosen, rejected = (logps - ref_logps).chunk(2)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen - rejected))
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * (chosen - rejected))
    elif loss_type == "ipo":
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        delta = chosen / chosen_tokens.clamp(min=1) - rejected / rejected_tokens.clamp(min=1)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    return losses, chosen, rejected


def pair_sums(logps, ref_logps, tokens, beta: float, loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss of the pairs, with autograd; every SUMS entry of these pairs, detached)."""
    losses, chosen, rejected = dpo_losses(logps, ref_logps, tokens, beta, loss_type)
    logps_chosen, logps_rejected = logps.detach().chunk(2)
    chosen, rejected = beta * chosen.detach(), beta * rejected.detach()
    sums = torch.stack([torch.tensor(float(len(losses)), device=logps.device), losses.detach().sum(), chosen.sum(),
                        rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                        logps_chosen.sum(), logps_rejected.sum(), logps.detach().sum(), tokens.sum().float()])
    return losses.sum(), sums


def means(sums: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """TRL's metrics (means over the pairs) and completion_loss: the cross-entropy over every completion token,
    chosen and rejected, of the weights this step started from (what verify recomputes on the first batch)."""
    values = dict(zip(SUMS, sums.tolist()))
    pairs = max(values["pairs"], 1.0)
    out = {f"{prefix}{k}": values[k] / pairs for k in SUMS[1:8]}
    out[f"{prefix}completion_loss"] = -values["completion_logp"] / max(values["completion_tokens"], 1.0)
    return out


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param.data


class Reference:
    """The frozen starting weights for the reference forward, swapped into the policy's own parameters in place:
    a copy of each parameter's local shard (full fine-tuning), or zeros for the adapters' B matrices (LoRA: the
    adapters' output B·A·x is then 0, which is the base with its adapters off). `adapters`: a LoRA run's
    pipeline.titan.lora.AdapterNames (torchtitan's or PEFT's), None for full fine-tuning."""

    def __init__(self, model_parts, adapters=None):
        self.model_parts = model_parts
        named = [(n, p) for part in model_parts for n, p in part.named_parameters()]
        self.lora = adapters is not None
        self.params = [p for n, p in named if n.endswith(adapters.b)] if self.lora else [p for _, p in named]
        if self.lora and not self.params:
            raise RuntimeError(f"DPO with LoRA: the model has no adapter B matrices (no parameter ends {adapters.b})")
        self.frozen: list[torch.Tensor] | None = None

    @torch.no_grad()
    def take(self, load_first=None) -> None:
        """The model's weights now are the reference (called once the starting weights are loaded); with
        `load_first`, the weights it loads are, and the model's own are put back after."""
        if self.lora:
            self.frozen = [torch.zeros_like(_local(p)) for p in self.params]
            return
        self.frozen = [_local(p).detach().clone() for p in self.params]  # the model's weights now
        if load_first:  # the starting weights into the model, then swapped: the model gets its own back, one
            load_first()  # parameter at a time, and frozen holds what was loaded (no third copy at any time)
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for param, frozen in zip(self.params, self.frozen):
            local = _local(param)
            policy = local.clone()
            local.copy_(frozen)
            frozen.copy_(policy)

    def _reshard(self) -> None:
        # Workaround: FSDP2 leaves a group with reshard_after_forward=False (torchtitan's norm and lm_head) gathered
        # after a no_grad forward, and the next forward reuses the gathered weights: without this, the policy's
        # forward would run on the reference's norm and lm_head. Resharding makes each forward gather the swapped shards.
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    @contextmanager
    def active(self):
        if self.frozen is None:
            raise RuntimeError("DPO: the reference weights were never taken (no checkpoint load ran)")
        self._reshard()
        self._swap()
        try:
            yield
        finally:
            self._reshard()
            self._swap()


class PreferenceValidator(Validator):
    """torchtitan's Validator for preference pairs: the first `steps` batches of the held-out pairs, the DPO loss
    and rewards of each (PreferenceTrainer.score), logged as eval_loss and eval_rewards/… (TRL's eval names)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    score = None  # PreferenceTrainer.score, set by the trainer

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        for model in model_parts:
            model.eval()
        sizes = ({"max_context_length": self.seq_len, "num_tokens_per_batch": self.num_tokens_per_batch}
                 if api.folded_batch() else {"seq_len": self.seq_len, "local_batch_size": self.local_batch_size})
        loader = self.dl_config.build(dp_world_size=self.dp_world_size, dp_rank=self.dp_rank, tokenizer=self.tokenizer,
                                      **sizes)
        total = None
        for number, (input_dict, labels) in enumerate(loader):
            if number >= self.config.steps:
                break
            _, sums = self.score(input_dict, labels, train=False)
            total = sums if total is None else total + sums
        for model in model_parts:
            model.train()
        if total is None:
            return
        metrics = means(total, "eval_")
        self.metrics_processor.log_validation(loss=metrics.pop("eval_loss"), step=step, extra_metrics=metrics)


class PreferenceTrainer(PipelineTrainer):
    """PipelineTrainer whose step is DPO's (module docstring) on batches of pair rows (pipeline.data.preference)."""

    @dataclass(kw_only=True, slots=True)
    class Config(PipelineTrainer.Config):
        dpo_beta: float = 0.1
        dpo_loss: str = "sigmoid"

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.reference = Reference(self.model_parts, getattr(self.checkpointer, "adapter_names", None))
        self.checkpointer.reference = self.reference
        self._sums: torch.Tensor | None = None
        self.metrics_processor.step_metrics = self._step_metrics
        if getattr(self, "validator", None) is not None and isinstance(self.validator, PreferenceValidator):
            self.validator.score = self.score
        logger.info(f"DPO: beta {config.dpo_beta}, loss {config.dpo_loss}, reference "
                    f"{'the base with its adapters off' if self.reference.lora else 'the starting weights, frozen'}")

    def _data_parallel(self) -> int:
        dims = self.parallel_dims
        return dims.get_mesh("batch").size() if dims.dp_enabled else 1

    def _reduced(self, sums: torch.Tensor) -> torch.Tensor:
        if self.parallel_dims.dp_enabled:
            torch.distributed.all_reduce(sums, group=self.parallel_dims.get_mesh("batch").get_group())
        return sums

    def score(self, input_dict, labels, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One microbatch of pair rows: the reference forward, the policy forward (and backward when training).
        Returns (this rank's summed pair loss, detached; the SUMS of the pairs of every data-parallel rank)."""
        input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
        inputs, labels, extra = self.post_dataloading_process(input_dict, labels.to(self.device))
        model, rows = self.model_parts[0], (api.seq_len_of(self.config.training), self.config.loss.global_vocab_size)
        with torch.no_grad(), self.reference.active(), self.train_context():
            ref_logps, _ = sequence_logps(model(inputs, **extra), labels, *rows)
        with self.train_context():
            logps, tokens = sequence_logps(model(inputs, **extra), labels, *rows)
            loss_sum, sums = pair_sums(logps, ref_logps, tokens, self.config.dpo_beta, self.config.dpo_loss)
            if train:
                (loss_sum / self._global_pairs(labels)).backward()
        return loss_sum.detach(), self._reduced(sums)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens=None, **kwargs):
        # torchtitan's train_step sums what this returns over microbatches and data-parallel ranks (its
        # global_avg_loss): this rank's pair-loss sum over the global pair count, so that sum is the global mean.
        loss_sum, sums = self.score(input_dict, labels)
        self._sums = sums if self._sums is None else self._sums + sums
        return loss_sum / self._global_pairs(labels)

    def _global_pairs(self, labels) -> int:
        rows = labels.numel() // api.seq_len_of(self.config.training)
        return rows // 2 * self.gradient_accumulation_steps * self._data_parallel()

    def _step_metrics(self) -> dict[str, float]:
        sums, self._sums = self._sums, None
        if sums is None:
            return {}
        own = means(sums)
        del own["loss"]  # torchtitan's train_step logs it (global_avg_loss), the same mean
        return own
