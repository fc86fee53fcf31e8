"""A client reading an export, run by whichever Python the test picks (the dev venv's transformers 5, the
transformers 4.57 venv of `make setup-transformers4`): loads <model dir> with AutoModelForCausalLM in
float32 and writes the logits of fixed token ids to <out>.safetensors, and prints what it read as JSON
(its transformers version, the rope_theta its config resolved to).

    python tests/client_logits.py <model dir> <out.safetensors>
"""

from __future__ import annotations

import json
import sys

IDS = [[9707, 11, 1879, 0, 576, 3974, 13876, 38835, 34208, 916, 279, 15678]]


def rope_theta(config) -> float:
    """transformers 4.x keeps it on the config, 5 in rope_parameters."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params["rope_theta"]) if "rope_theta" in params else float(config.rope_theta)


def main(model_dir: str, out: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits
    save_file({"logits": logits.contiguous()}, out)
    print(json.dumps({"transformers": transformers.__version__, "rope_theta": rope_theta(model.config)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
