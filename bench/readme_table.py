"""README's table of measured figures, written from bench/results.json (`make bench` runs this after
measuring), so the README never states a figure the last bench run did not measure.

  python bench/readme_table.py           rewrite the table between README's markers
  python bench/readme_table.py --check   exit 1 when README's table is not what results.json gives
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results.json"
README = REPO / "README.md"
BEGIN = "<!-- bench table: written by bench/readme_table.py from bench/results.json (make bench); do not edit -->"
END = "<!-- end of bench table -->"


def _median(entry: dict) -> float:
    return float(entry["median"])


def _samples(entry: dict, spec: str) -> str:
    return ", ".join(f"{s:{spec}}" for s in entry["samples"])


def rows(results: dict) -> list[tuple[str, str, str]]:
    """(what was measured, the figure, when): every section results.json holds, in the order `make bench` runs them."""
    at = results.get("measured_at", {})
    found = []
    if "overhead" in results:
        ratio = results["overhead"]["ratio"]
        found.append(("native step vs a bare PyTorch loop (same computation, 1 rank)",
                      f"{_median(ratio):.2f}× (samples {_samples(ratio, '.2f')})", at.get("overhead", "")))
    for path, marks in results.get("ttfs", {}).items():
        found.append((f"`make train-{path}` → step 1", f"{_median(marks['total']):.1f} s", at.get("ttfs", "")))
    for name, entry in results.get("scaling", {}).items():
        found.append((f"scaling, {name}: steady step", f"{_median(entry['steady_step_s']):.3f} s", at.get("scaling", "")))
    size = results.get("size") or {}
    model = size.get("model", "Hub-shaped model")
    train = size.get("train_one_rank") or {}
    if "peak_over_estimate" in train:
        found.append((f"{model}: peak memory per rank vs the estimate", f"{train['peak_over_estimate']:.2f}×",
                      at.get("size", "")))
    if "export_s" in size:
        found.append((f"{model}: export of {size['bytes'] / 2**30:.1f} GiB ({size['dtype']})",
                      f"{_median(size['export_s']):.2f} s = {_median(size['export_throughput_over_cp']):.2f}× cp's "
                      "throughput", at.get("size", "")))
        found.append((f"{model}: verify vs from_pretrained + one forward",
                      f"{_median(size['verify_repeat_over_plain']):.2f}× (first verify "
                      f"{_median(size['verify_first_over_plain']):.2f}×)", at.get("size", "")))
    if "pipeline" in results:
        found.append(("`make pipeline` (tiny + tiny-moe, every path)", f"{_median(results['pipeline']['wall_s']):.0f} s",
                      at.get("pipeline", "")))
    peers = results.get("peers") or {}
    for kind, trainer in (("sft", "SFTTrainer"), ("dpo", "DPOTrainer")):
        entry = peers.get(kind)
        if not entry:
            continue
        model, settings = peers["model"], entry["settings"]
        found.append((f"{kind.upper()}: pipeline vs TRL {trainer}, real tokens/s ({model['hub_config']} shape, "
                      f"{model['num_hidden_layers']} layers, seq {settings['seq_len']} × {settings['local_batch_size']}, "
                      f"float32, {entry['threads']} threads; interleaved)",
                      f"{_median(entry['pipeline_tokens_per_s']):.0f} vs {_median(entry['trl_tokens_per_s']):.0f} = "
                      f"{_median(entry['ratio']):.2f}× (samples {_samples(entry['ratio'], '.2f')}); step-1 loss "
                      f"{entry['pipeline_step1_loss']:.4f} vs {entry['trl_step1_loss']:.4f} (on the same rows Δ "
                      f"{entry['same_rows_step1_loss_abs_diff']:.1g}); peak RSS "
                      f"{_median(entry['pipeline_peak_rss_mib']) / 1024:.1f} vs {_median(entry['trl_peak_rss_mib']) / 1024:.1f} GiB",
                      at.get("peers", "")))
    sft = peers.get("sft") or {}
    if "packing_efficiency" in sft:
        packing = sft["packing_efficiency"]
        found.append(("SFT: real tokens / tokens computed (packing)",
                      f"pipeline {packing['pipeline_step1']:.0%} (rows padded to seq_len); TRL 100% (padding-free; its "
                      f"best-fit rows {packing['trl']['efficiency']:.0%} full)", at.get("peers", "")))
    profile = sft.get("profile") or {}
    if "pipeline" in profile:
        real = sft["pipeline"][0]["real_tokens_step1"]  # the profiled pipeline batch is run 1's step 1
        pipe, trl, full = profile["pipeline"], profile["trl"], profile["trl_full_logits"]
        found.append((f"SFT: one step each in one process, fastest of {profile['repeats']} (the pipeline's batch through "
                      "transformers' model, as bench/bare_loop.py): real tokens/s",
                      f"pipeline {real / pipe['step_s']:.1f} vs TRL {trl['tokens'] / trl['step_s']:.1f} = "
                      f"{real / pipe['step_s'] / (trl['tokens'] / trl['step_s']):.2f}×; TRL's batch with every "
                      f"position's logits {full['tokens'] / full['step_s']:.1f}", at.get("peers", "")))

        def split(side: dict) -> str:
            return (f"{side['lm_head_and_loss_cpu_s']:.1f} + {side['backbone_cpu_s']:.1f} "
                    f"({side['attention_s']:.2f} s) for {side['tokens']} tokens, {side['labelled']} labelled")
        found.append(("SFT: that step's CPU seconds, LM head + loss + backbone (attention): pipeline · TRL · TRL's batch "
                      "with every position's logits", " · ".join(split(profile[k]) for k in ("pipeline", "trl", "trl_full_logits")),
                      at.get("peers", "")))
    return found


def render(results: dict) -> str:
    host = results.get("host", {})
    lines = [BEGIN, "", f"Last `make bench` on {host.get('cpus', '?')} CPU cores (torch {host.get('torch', '?')}):", "",
             "| measured | figure | on |", "|---|---|---|"]
    lines += [f"| {what} | {figure} | {when[:10]} |" for what, figure, when in rows(results)]
    return "\n".join(lines + ["", END])


def replaced(readme: str, table: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"error: {README} has no bench table markers ({BEGIN!r} … {END!r}). "
                         "Fix: put both lines where the table goes.")
    head, rest = readme.split(BEGIN, 1)
    return head + table + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that README's table is current")
    args = parser.parse_args(argv)
    readme = README.read_text()
    wanted = replaced(readme, render(json.loads(RESULTS.read_text())))
    if args.check:
        if wanted != readme:
            print(f"error: {README}'s bench table is not what {RESULTS} gives. Fix: run `python bench/readme_table.py`.",
                  file=sys.stderr)
            return 1
        return 0
    if wanted != readme:
        README.write_text(wanted)
        print(f"wrote the bench table into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
