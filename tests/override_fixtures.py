"""An override claiming whole MoE layers, to provoke the ancestor conflict in tests."""

from torchtitan.config import derive, override
from torchtitan.models.common.moe import MoE


@override(target=MoE.Config, fqns=["*.moe"], description="test fixture")
def whole_moe(cfg: MoE.Config) -> MoE.Config:
    return derive(cfg, MoE.Config)
