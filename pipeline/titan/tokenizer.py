"""A tokenizer read from a directory of its own rather than the trainer's hf_assets_path, which also
names the checkpoint the weights come from: training Qwen3's weights on torchtitan's test tokenizer
(AWS's smoke run, pipeline/titan/assets.py) needs the two apart. torchtitan 0.3.0 and
upstream main both build the tokenizer as `config.tokenizer.build(tokenizer_path=hf_assets_path)`."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.tokenizer import HuggingFaceTokenizer


class DirectoryTokenizer(HuggingFaceTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        directory: str = ""

    def __init__(self, config: Config | None = None, *, tokenizer_path: str):
        super().__init__(config, tokenizer_path=config.directory if config and config.directory else tokenizer_path)
