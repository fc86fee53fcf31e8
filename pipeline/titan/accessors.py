"""Accessors for the private torchtitan names the pipeline uses: its other modules call these, never
the private names themselves.

Every name reached here is listed in `pipeline.titan.internals` (TORCHTITAN_INTERNALS, with why it
is used), whose check runs in the launcher before any rank starts. This module and internals.py are
the only ones that name a private torchtitan name (tests/titan/test_titan_internals.py checks it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


def qwen3_layers(**kwargs):
    from torchtitan.models import qwen3

    return qwen3._build_qwen3_layers(**kwargs)


def qwen3_moe_layers(**kwargs):
    from torchtitan.models import qwen3

    return qwen3._build_qwen3_moe_layers(**kwargs)


def qwen3_norm(dim: int):
    from torchtitan.models import qwen3

    return qwen3._qwen3_norm(dim)


def qwen3_eps() -> float:
    from torchtitan.models import qwen3

    return qwen3._EPS


def qwen3_inits(tied: bool) -> dict:
    """torchtitan's Qwen3 parameter inits: the embedding's (skipped when tied to the lm_head) and the lm_head's."""
    from torchtitan.models import qwen3

    return {"embedding": qwen3._EMBEDDING_SKIP_INIT if tied else qwen3._EMBEDDING_INIT, "lm_head": qwen3._LINEAR_INIT}


def registered_override(name: str):
    """The torchtitan Override registered under `module.function`, or None."""
    override = importlib.import_module("torchtitan.config.override")  # the module, not the decorator
    return override._REGISTRY.get(name)


def traverse(config, config_cls: type, prefix: str, recurse: bool = False):
    """config.traverse with FQNs rooted at `prefix` (as torchtitan's override matching sees them)."""
    return config.traverse(config_cls, recurse=recurse, _prefix=prefix)


def config_owner(config):
    """The class a Configurable.Config builds (torchtitan wires it when the class declares its nested Config)."""
    return type(config)._owner


def router_forces_load_balance(router_config) -> bool:
    return bool(router_config._debug_force_load_balance)


def checkpoint_manager_base():
    """torchtitan's CheckpointManager with public hooks, `before_save(step, last_step)`,
    `after_save(step, last_step)` and `after_load(step, loaded)`, plus `step_folder(step)` and
    `save_model_in_hf(state, checkpoint_id, wrap_adapter)`;
    titan/trainer.py subclasses this instead of overriding private methods."""
    global _HOOKED
    if _HOOKED is None:
        _HOOKED = _make_hooked_checkpoint_manager()
    return _HOOKED


_HOOKED = None


def _make_hooked_checkpoint_manager():
    from torchtitan.components.checkpointer import CheckpointManager

    class HookedCheckpointManager(CheckpointManager):
        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            if not self._should_save(curr_step, last_step):
                return False
            self.before_save(curr_step, last_step)
            saved = super()._save(curr_step, last_step)
            if saved:
                self.after_save(curr_step, last_step)
            return saved

        def _load(self, step: int = -1) -> bool:
            loaded = super()._load(step)
            self.after_load(self._find_load_step() if step == -1 else step, loaded)
            return loaded

        def step_folder(self, step: int) -> str:
            return self._create_checkpoint_id(step)

        def save_model_in_hf(self, state: dict, checkpoint_id: str, wrap_adapter=None) -> None:
            """`state` through torchtitan's HF writer (its public dcp_save with to_hf, synchronous), the
            run's state-dict adapter wrapped by `wrap_adapter` for this one save. `sd_adapter` is the
            attribute dcp_save converts through, on 0.3.0 and main alike."""
            from torchtitan.components.checkpointer import AsyncMode

            adapter = self.sd_adapter
            if wrap_adapter is not None:
                self.sd_adapter = wrap_adapter(adapter)
            try:
                self.dcp_save(state, checkpoint_id=checkpoint_id, async_mode=AsyncMode.DISABLED, to_hf=True)
            finally:
                self.sd_adapter = adapter

        def load_starting_weights(self) -> None:
            """The model's weights from initial_load_path as a fresh start loads them (the run's source, HF
            safetensors, model only), through the public dcp_load; a resumed DPO run's reference is these."""
            from torchtitan.components.checkpointer import MODEL

            self.dcp_load(self.states[MODEL].state_dict(), checkpoint_id=self.initial_load_path,
                          from_hf=self.initial_load_in_hf, from_quantized=False)

        def before_save(self, step: int, last_step: bool) -> None:
            pass

        def after_save(self, step: int, last_step: bool) -> None:
            pass

        def after_load(self, step: int, loaded: bool) -> None:
            pass

    return HookedCheckpointManager


def vocab_parallel_token_nll(local_logits, labels, tp_group, global_vocab_size: int):
    """Each token's negative log-likelihood from this rank's vocabulary shard of the logits, exact over the whole
    vocabulary (torchtitan's loss-parallel cross-entropy, reduction "none", with its fused backward)."""
    from torchtitan.components.loss import _LossParallelCrossEntropy

    return _LossParallelCrossEntropy.apply(local_logits, labels, tp_group, global_vocab_size, "none")
