"""Build a SIMULATED torchtitan "main after #4328": the upstream-main wheel of 2026-08-21 with the change
pytorch/torchtitan#4328 (merged ~2026-08-26) describes, applied by this project's own edits:

- `ModelSpec` gains a required `max_context_length`;
- `model_registry(flavor, seq_len=...)` (qwen3's) sizes the RoPE caches when the spec is built, asking for
  more than the flavor's maximum raises ValueError, and the spec carries the length;
- `Decoder.Config.update_from_config` no longer resizes RoPE caches or validates the training length, and
  `Decoder.Config.max_context_length` is gone.

It is a simulation: no source of upstream main after 2026-08-23 can be had here, so these edits follow the
PR's description, not its diff. Left as the wheel has them: the other models' registries and the RL
experiments (they would fail when called; the pipeline calls none of them). The wheel it writes reports
version SIM_VERSION, so nothing mistakes it for a real torchtitan.

    python tests/titan_sim.py <torchtitan main wheel> <output dir>   → prints the simulated wheel's path
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

SIM_VERSION = "0.2.2+sim.pr4328"


def _once(pattern: str, replacement: str, *, flags: int = 0):
    def edit(text: str, path: str) -> str:
        new, count = re.subn(pattern, replacement, text, count=2, flags=flags)
        if count != 1:
            raise SystemExit(f"titan_sim: {path}: expected one match of {pattern!r}, found {count}: "
                             "this wheel is not upstream main of 2026-08-21")
        return new
    return edit


EDITS = {
    "torchtitan/protocols/model_spec.py": [
        # a required field, after the others (none has a default)
        _once(r"(\n    state_dict_adapter: type\[BaseStateDictAdapter\] \| None\n)",
              r"\1    # simulated #4328: the spec states the model's context length\n    max_context_length: int\n"),
    ],
    "torchtitan/models/common/decoder.py": [
        # Decoder.Config.max_context_length is gone
        _once(r"\n        @property\n        def max_context_length\(self\) -> int:\n.*?return rope_cfg\.max_context_length\n",
              "", flags=re.S),
        # update_from_config keeps only the MoE debug flag: no length check, no RoPE resize
        _once(r"(                debug = config\.debug\n)                seq_len = config\.training\.max_context_length\n"
              r".*?(                    if hasattr\(layer_cfg, \"moe\"\) and layer_cfg\.moe is not None:\n)",
              r"\1                for layer_cfg in self.layers:\n\2", flags=re.S),
    ],
    "torchtitan/models/qwen3/__init__.py": [
        _once(r"(    converters: list\[ModelConfigConverter\.Config\] \| None = None,\n)(\) -> ModelSpec:\n)",
              r"\1    seq_len: int | None = None,\n\2"),
        _once(r"(            config = c\.build\(\)\.convert\(config\)\n)(    return ModelSpec\(\n)",
              r"\1    # simulated #4328: the flavor's maximum, the spec's length, RoPE caches sized when the spec is built\n"
              r"    flavor_max = config.layers[0].attention.rope.max_context_length\n"
              r"    context = seq_len or flavor_max\n"
              r"    if context > flavor_max:\n"
              r"        raise ValueError(f'seq_len {context} exceeds the max context length {flavor_max} of flavor {flavor}')\n"
              r"    import dataclasses\n"
              r"    for layer in config.layers:\n"
              r"        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_context_length=context)\n"
              r"\2        max_context_length=context,\n"),
    ],
}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build(source: Path, out_dir: Path) -> Path:
    with zipfile.ZipFile(source) as wheel:
        members = {info.filename: wheel.read(info) for info in wheel.infolist() if not info.is_dir()}
    old_info = next(name.split("/", 1)[0] for name in members if name.endswith(".dist-info/METADATA"))
    version = old_info.removeprefix("torchtitan-").removesuffix(".dist-info")
    if version != "0.2.2":
        raise SystemExit(f"titan_sim: {source} is torchtitan {version}, not upstream main's 0.2.2")
    new_info = f"torchtitan-{SIM_VERSION}.dist-info"
    files: dict[str, bytes] = {}
    for name, data in members.items():
        if name in EDITS:
            text = data.decode()
            for edit in EDITS[name]:
                text = edit(text, name)
            data = text.encode()
        if name.startswith(old_info + "/"):
            if name.endswith("/RECORD"):
                continue
            name = new_info + name[len(old_info):]
            if name.endswith("/METADATA"):
                data = re.sub(rb"(?m)^Version: .*$", f"Version: {SIM_VERSION}".encode(), data, count=1)
        files[name] = data
    missing = set(EDITS) - set(members)
    if missing:
        raise SystemExit(f"titan_sim: {source} lacks {', '.join(sorted(missing))}")
    record = f"{new_info}/RECORD"
    lines = [_record_line(name, data) for name, data in files.items()] + [f"{record},,"]
    files[record] = ("\n".join(lines) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"torchtitan-{SIM_VERSION}-py3-none-any.whl"
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    partial.replace(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.rsplit("\n\n", 1)[-1].strip())
    print(build(Path(sys.argv[1]), Path(sys.argv[2])))
