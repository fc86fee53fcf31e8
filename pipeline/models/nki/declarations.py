"""What the nki path may replace, declared once (no torch import: dry runs read it too).

A config's `nki_overrides` names groups ("rope", "moe"); each group is one or more overrides,
each with the module pattern it claims (torchtitan FQN globs, from the Trainer.Config root),
the NKI kernel it runs on `neuron`, and what a model must have for it to apply.
"""

from __future__ import annotations

from dataclasses import dataclass

MODULE = "pipeline.models.nki.overrides"


@dataclass(frozen=True)
class NkiOverride:
    function: str  # @override factory in pipeline.models.nki.overrides
    replaces: str  # torchtitan Config class, for messages
    fqns: tuple[str, ...]
    kernel: str  # key of constraints.KERNEL_RULES
    needs_experts: bool = False  # only Mixture-of-Experts models have the module it replaces

    @property
    def target(self) -> str:
        return f"{MODULE}.{self.function}"

    def skip_reason(self, arch: dict) -> str | None:
        """Why this override does not apply to a model, or None when it does."""
        if self.needs_experts and not arch.get("num_experts"):
            return f"the model is dense (no experts), so it has no {self.replaces}"
        return None


GROUPS: dict[str, list[NkiOverride]] = {
    "rope": [NkiOverride("nki_rope", "CosSinRoPE", ("*.attention.rope",), "rope_hf")],
    "moe": [
        NkiOverride("nki_router", "TokenChoiceTopKRouter", ("*.moe.router",), "router_topk", needs_experts=True),
        NkiOverride("nki_experts", "GroupedExperts", ("*.moe.routed_experts.inner_experts",), "moe_cte",
                    needs_experts=True),
    ],
}

BY_FUNCTION = {o.function: o for group in GROUPS.values() for o in group}
