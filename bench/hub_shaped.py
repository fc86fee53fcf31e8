"""A Hub-shaped checkpoint made locally, for measuring at a size that matters: the real
config.json of a Hub model (configs/hub_configs/<name>.json, verbatim), transformers' own
initialisation under a fixed seed in the config's dtype, saved by save_pretrained, and the
Qwen3 tokenizer of the embedded models. Made once per directory (a `.complete` mark). `overrides`
(e.g. fewer layers, for a section that must finish in minutes on 2 cores) replace those keys only;
config.json is then the Hub's file with them replaced, and `hub_shaped.json` says which.

Usage: hub_shaped.py <dest dir> <hub config name, e.g. Qwen3-0.6B> <tokenizer dir>
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make(dest: Path, name: str, tokenizer_dir: Path, overrides: dict | None = None) -> Path:
    dest = Path(dest)
    if (dest / ".complete").exists():
        return dest
    import torch
    import transformers

    config_json = json.loads((REPO / "configs" / "hub_configs" / f"{name}.json").read_text())
    unknown = set(overrides or {}) - set(config_json)
    if unknown:
        raise SystemExit(f"hub_shaped: {sorted(unknown)} are not keys of {name}'s config.json")
    config_json.update(overrides or {})
    dtype = getattr(torch, config_json.get("torch_dtype") or config_json.get("dtype") or "bfloat16")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**config_json)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(tmp, max_shard_size="5GB")
    del model
    (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")  # the Hub's file, verbatim but overrides
    (tmp / "hub_shaped.json").write_text(json.dumps({"hub_config": name, "overrides": overrides or {}}) + "\n")
    from pipeline.checkpoint.embedded import TOKENIZER_FILES

    for file in TOKENIZER_FILES:
        shutil.copy2(Path(tokenizer_dir) / file, tmp / file)
    (tmp / ".complete").write_text("")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    print(make(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])))
