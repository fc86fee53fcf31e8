"""The two torchtitan APIs this pipeline runs on, told apart by what the installed torchtitan has.

- `0.3.0`: PyPI's torchtitan 0.3.0 (requirements-dev.lock): batches are [B, L]
  (`training.local_batch_size`, `training.seq_len`), text comes from `HuggingFaceTextDataLoader`
  and its `DATASETS` registry, RoPE's cache length is `max_seq_len`.
- `main`: upstream torchtitan `main` after 2026-08-20, the base of AWS's torchtitan-neuron
  "0.2.2+neuron.1" (the image's; both report version 0.2.2, so the version string decides nothing):
  #4121 folded the batch dimension (a batch is [T] packed tokens, `training.
  num_tokens_per_microbatch_per_dp_rank`, `training.max_context_length`, RoPE's
  `max_context_length`, attention tensors [T, N, H]) and moved text loading to a Grain loader
  (`components/data`: a source, a processor and a packing config per dataset); #4184 removed the
  `torchtitan.components.checkpoint` import path (both have `components.checkpointer`).

Each difference is answered here once; callers never test the variant themselves. Which one is
installed is read from torchtitan's own config class, not from its version.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

MAIN = "main"
V030 = "0.3.0"
UNKNOWN = "unknown"
DESCRIPTION = {
    UNKNOWN: "neither API this pipeline knows (no torchtitan/config/configs.py)",
    V030: "torchtitan 0.3.0 API ([B, L] batches, HuggingFaceTextDataLoader)",
    MAIN: "upstream torchtitan main API of 2026-08-20 or later, as torchtitan-neuron "
          "([T] folded batches, max_context_length, Grain data loader)",
}


@functools.cache
def variant() -> str:
    """The installed torchtitan's API (see variant_at)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("torchtitan is not installed")
    return variant_at(Path(spec.origin).parent)


def variant_at(package_dir: Path) -> str:
    """`main` when the torchtitan package at `package_dir` declares `training.max_context_length` (#4121),
    else `0.3.0`. Read from the source of its config/configs.py, so the launcher and doctor need not
    import torch; inside a rank `variant_of_imported()` asks the class itself and agrees."""
    configs = Path(package_dir) / "config" / "configs.py"
    if not configs.is_file():
        return UNKNOWN  # neither API (an older torchtitan, or a fork laid out otherwise)
    return MAIN if "max_context_length:" in configs.read_text() else V030


def variant_of_imported() -> str:
    from dataclasses import fields

    from torchtitan.config import TrainingConfig

    return MAIN if "max_context_length" in {f.name for f in fields(TrainingConfig)} else V030


def folded_batch() -> bool:
    return variant() == MAIN


def training_config(*, local_batch_size: int, seq_len: int, **common):
    """torchtitan's TrainingConfig for `local_batch_size` sequences of `seq_len` tokens per rank
    and step. main counts tokens, not sequences (#4121): the same tokens, packed into one row."""
    from torchtitan.config import TrainingConfig

    if folded_batch():
        return TrainingConfig(num_tokens_per_microbatch_per_dp_rank=local_batch_size * seq_len,
                              max_context_length=seq_len, **common)
    return TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, **common)


def seq_len_of(training) -> int:
    return getattr(training, context_field())


def with_batch_dim(batched_ndim: int, *tensors):
    """(tensors with a leading batch dim, whether one was added). main's attention and RoPE see
    [T, …] packed tokens (#4121); the pipeline's overrides are written for [B, T, …] (`batched_ndim`
    dims) and see a batch of one there. Undo with `drop_batch_dim`."""
    added = tensors[0].dim() == batched_ndim - 1
    if not added:
        return tensors, False
    return tuple(t.unsqueeze(0) if t is not None else None for t in tensors), True


def drop_batch_dim(tensor, added: bool):
    return tensor.squeeze(0) if added else tensor


def text_dataloader(source, registered_name: str):
    """torchtitan's text loader over the pipeline's DataSource (pipeline.data.dataset).

    0.3.0: HuggingFaceTextDataLoader by the name the source is registered under in its DATASETS.
    main: the Grain loader over the same source, tokenised by torchtitan's TextProcessor and packed
    by concatenation into one row per batch (as torchtitan's own configs do), in file order as
    0.3.0 reads it (no shuffle), so both variants train on the same documents first."""
    if not folded_batch():
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

        return HuggingFaceTextDataLoader.Config(dataset=registered_name, infinite=True)
    from torchtitan.components.data import ConcatThenSplitPackingConfig, GrainDataLoader
    from torchtitan.hf_datasets.text_datasets import DATASETS

    return GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=DATASETS[registered_name]),
                                  shuffle=False, repeat=True)


def chat_dataloader(data_file: str, processor):
    """main only: the Grain loader over a chat JSON-lines file, conversations packed first-fit (each
    keeps its own positions, so attention stays within it), in file order, `processor` tokenising."""
    from torchtitan.components.data import (FirstFitPackingConfig, GrainDataLoader, HuggingFaceRandomAccessSource,
                                            SingleDatasetConfig)

    source = HuggingFaceRandomAccessSource.Config(path="json", split="train", load_dataset_kwargs={"data_files": data_file})
    return GrainDataLoader.Config(dataset=FirstFitPackingConfig(dataset=SingleDatasetConfig(
        source=source, processor=processor, post_filters=(_is_sample,))), shuffle=False, repeat=True)


def register_text_dataset(name: str, kind: str, location: str | list[str], file_format: str | None,
                          wrap_loader=lambda loader: loader) -> None:
    """Add a file (`json`/`text`) or a Hub dataset (`kind == "hub"`) to torchtitan's DATASETS under
    `name`, each row's "text" being one document. 0.3.0 loads through a function of ours, which
    `wrap_loader` may wrap; main's sources load themselves."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if not folded_batch():
        from datasets import load_dataset
        from torchtitan.hf_datasets import DatasetConfig

        if kind == "hub":
            def loader(path):
                return load_dataset(path, split="train", streaming=True)
        elif file_format == "json":
            def loader(path):
                return load_dataset("json", data_files=path, split="train")
        else:
            def loader(path):
                return load_dataset("text", data_files=path, split="train", sample_by="paragraph")
        DATASETS[name] = DatasetConfig(path=location, loader=wrap_loader(loader), sample_processor=lambda s: s["text"])
        return
    from torchtitan.components.data import (HuggingFaceRandomAccessSource, HuggingFaceStreamingSource,
                                            SingleDatasetConfig)
    from torchtitan.hf_datasets.text_datasets import TextProcessor

    if kind == "hub":
        source = HuggingFaceStreamingSource.Config(path=location, split="train")
    elif file_format == "json":
        source = HuggingFaceRandomAccessSource.Config(path="json", split="train",
                                                      load_dataset_kwargs={"data_files": location})
    else:
        source = HuggingFaceRandomAccessSource.Config(path="text", split="train",
                                                      load_dataset_kwargs={"data_files": location,
                                                                           "sample_by": "paragraph"})
    DATASETS[name] = SingleDatasetConfig(source=source, processor=TextProcessor.Config(),
                                         post_filters=(_is_sample,))


def _is_sample(sample) -> bool:
    return sample is not None


def forward_signature_of(parent_forward):
    """Give a replacement module's forward the signature of the forward it replaces. main looks up
    each positional parameter's sharding by its name (protocols/module.py, `_cache_pos_arg_names`),
    and #4121 renamed them (q_BLNH → q_TNH): one replacement serves both variants this way."""
    import inspect

    def adopt(forward):
        forward.__signature__ = inspect.signature(parent_forward)
        return forward

    return adopt


# torchtitan's own text datasets and the path each reads (hf_datasets/text_datasets.py DATASETS), named
# here so the launcher checks DATASET= without importing torchtitan; tests/data/test_data_dataset.py
# keeps each equal to its variant's registry. main reads c4_test's JSON file, 0.3.0 its folder.
TITAN_DATASETS = {
    V030: {"c4": "allenai/c4", "c4_test": "tests/assets/c4_test", "c4_validation": "allenai/c4"},
    MAIN: {"c4": "allenai/c4", "c4_test": "tests/assets/c4_test/data.json", "c4_validation": "allenai/c4"},
}


def titan_datasets() -> dict[str, str]:
    return TITAN_DATASETS[variant()]


def relocate_titan_dataset(name: str, location: str) -> None:
    """Point torchtitan's own dataset `name`, registered with a path relative to the working directory
    (c4_test: tests/assets/…), at `location`, the same files found elsewhere (an absolute path): the ranks'
    working directory need not be a torchtitan checkout. 0.3.0 keeps the path in `path`, main in the
    source's `load_dataset_kwargs["data_files"]` (registered_dataset_paths reads both)."""
    import dataclasses

    from torchtitan.hf_datasets.text_datasets import DATASETS

    config = DATASETS[name]
    if not folded_batch():
        DATASETS[name] = dataclasses.replace(config, path=location)
        return
    source = config.source
    if "data_files" in (source.load_dataset_kwargs or {}):
        source = dataclasses.replace(source, load_dataset_kwargs={**source.load_dataset_kwargs, "data_files": location})
    else:
        source = dataclasses.replace(source, path=location)
    DATASETS[name] = dataclasses.replace(config, source=source)


def registered_dataset_paths() -> dict[str, str]:
    """{name: path read} of the installed torchtitan's DATASETS (what TITAN_DATASETS must equal)."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if not folded_batch():
        return {name: config.path for name, config in DATASETS.items()}
    return {name: config.source.load_dataset_kwargs.get("data_files", config.source.path)
            for name, config in DATASETS.items()}


def build_text_loader(loader_config, *, tokenizer, seq_len: int, local_batch_size: int):
    """A text loader config built as torchtitan's Trainer builds it on one data-parallel rank."""
    if folded_batch():
        return loader_config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, max_context_length=seq_len,
                                   num_tokens_per_batch=local_batch_size * seq_len)
    return loader_config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len,
                               local_batch_size=local_batch_size)


def context_field() -> str:
    """TrainingConfig's sequence length: `seq_len` (0.3.0), `max_context_length` (main)."""
    return "max_context_length" if folded_batch() else "seq_len"


def batch_field() -> str:
    """TrainingConfig's per-rank batch: `local_batch_size` sequences (0.3.0), or tokens (main)."""
    return "num_tokens_per_microbatch_per_dp_rank" if folded_batch() else "local_batch_size"
