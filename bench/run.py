"""`make bench`: the pipeline's costs, each ratio measured side by side in one run on this machine.

Sections (BENCH_ONLY=a,b picks some; BENCH_REPEATS=n, n ≥ 2, repeats each measurement; the two
sides of a ratio alternate within each repeat):
  overhead  steady-state step of train-native (1 rank) vs a bare PyTorch loop doing the same
            computation (bench/bare_loop.py: same weights, batch, mask, loss, optimizer, dtype,
            threads; its step-1 loss must equal the pipeline's and its threads the rank's)
  ttfs      `make train-<path>` to step 1, split by the start-up marks (timings.json)
  scaling   1 vs 2 ranks, eager and torch.compile: first step and steady state
  export    tiny: export vs cp of the same bytes and verify vs from_pretrained + one forward,
            both sides in-process (bench/inproc.py)
  size      a Hub-shaped Qwen3-0.6B made locally (bench/hub_shaped.py, ≥ 1 GiB): trained at the CPU
            target's defaults (peak memory per rank vs the stated estimate, the weights copy vs DCP),
            exported (throughput vs cp, peak RSS vs the largest tensor), verified (vs
            from_pretrained + one forward; first and repeated verify)
  pipeline  `make pipeline` (the README command) on the embedded defaults, wall time
  peers     SFT and DPO on the pipeline (configs/finetune/{sft,dpo}.toml) vs TRL's SFTTrainer / DPOTrainer
            (bench/peers.py) on the same Hub-shaped model (Qwen3-0.6B's config, fewer layers: the real
            vocabulary and layer shape), data, seq len, batch, float32, lr, optimizer and threads, the two
            alternating: steady real (non-padding) tokens/s, step-1 loss, peak RSS, the ratios; and one
            profiled step of each (attention, vocabulary-sized ops, the rest)
Every stage run is a child process; its max RSS (largest process of its tree) comes from wait4.
Prints a table and writes bench/results.json; sections not run keep their earlier figures, dated.
Outputs go under PIPELINE_CHECKPOINTS (default a temp dir).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import envvars

REPO = Path(__file__).resolve().parent.parent

PY = sys.executable
SECTIONS = ("overhead", "ttfs", "scaling", "export", "size", "pipeline", "peers")
STEPS = 12
OVERHEAD_STEPS = 20
SIZE_MODEL = "Qwen3-0.6B"  # configs/hub_configs/<name>.json
GIB = 2**30
# peers: Qwen3-0.6B's layers and its 151,936-word vocabulary, 2 of its 28 layers; the LM head and loss, the part a
# vocabulary this size makes dominant, are full size. Even so one step of 1,024 tokens took 49 s on 2 busy cores
# (2026-12-07), so the section (8 trainings) runs 256-token SFT rows (the chat set's conversations: median 95
# tokens, all but one ≤ 256) and 128-token DPO rows (pairs: median 68, 402 of 413 ≤ 128), one row (pair) a step.
PEERS_MODEL, PEERS_OVERRIDES = "Qwen3-0.6B", {"num_hidden_layers": 2}
PEERS_STEPS = 5
PEERS_WORK = {"sft": {"seq_len": 256, "local_batch_size": 1}, "dpo": {"seq_len": 128, "local_batch_size": 1}}
PEERS_SAME_ROWS_TOLERANCE = 1e-4  # |Δ step-1 loss| on the same conversations, two float32 implementations
SCHEMA = 2  # issue 14's bench; results.json files of an older schema are replaced, not merged


def run(cmd: list[str], env: dict, cwd: Path = REPO, check: bool = True) -> dict:
    """Run a child; wall time and max RSS of its process tree (ru_maxrss covers waited descendants)."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 and check:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({code}):\n{out[-3000:]}")
    return {"start": start, "wall_s": time.time() - start, "max_rss_mib": usage.ru_maxrss / 1024, "out": out, "code": code}


def last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values), "samples": values}


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


class Bench:
    def __init__(self, root: Path, repeats: int):
        self.root = root
        self.repeats = repeats
        self.env = {**os.environ, envvars.CHECKPOINTS: str(root)}
        self.memory: dict[str, list[float]] = {}
        self.results: dict = {}

    def home(self, model: str):
        from pipeline.run import store

        return store.home(model, self.root)

    def pipe(self, stage: str, *args: str, label: str | None = None, check: bool = True) -> dict:
        result = run([PY, "-m", "pipeline", stage, *args], self.env, check=check)
        if result["code"] == 0:
            self.memory.setdefault(label or stage, []).append(result["max_rss_mib"])
        return result

    def train(self, *args: str, label: str, model: str = "tiny") -> Path:
        self.pipe("train", "--model", model, "--fresh", *args, label=label)
        return self.home(model).run(args[args.index("--path") + 1]).path

    def config(self, **changes) -> str:
        """A CONFIG file with these [train] keys, layered over configs/cpu.toml by the train stage."""
        path = self.root / f"bench-{'-'.join(f'{k}{v}' for k, v in changes.items())}.toml"
        path.write_text("[train]\n" + "".join(f"{key} = {value}\n" for key, value in changes.items()))
        return str(path)

    def prepare(self, model: str = "tiny") -> None:
        home = self.home(model)
        if not home.is_downloaded():
            self.pipe("download", "--model", model)
        if not home.data_file.exists():
            self.pipe("data", "--model", model)

    # ---- overhead ----------------------------------------------------------------------------

    def overhead(self) -> None:
        from pipeline.run.rundir import RunDir

        pipeline, bare, losses, threads = [], [], [], []
        for _ in range(self.repeats):
            # No checkpoint save inside the run: a save (and the heap trim after it) is not part of a step,
            # and the steps after one pay for re-faulting the memory it returned (measured 1.12x with saves
            # every 5 steps, ~1.01x without, 2026-12-02).
            run_dir = self.train("--path", "native", "--steps", str(OVERHEAD_STEPS), "--nproc-per-node", "1",
                                 "--config", self.config(checkpoint_interval=10 * OVERHEAD_STEPS), label="train native 1 rank")
            spec = json.loads(RunDir(run_dir).run_json.read_text())
            pipeline.append(steady(run_dir, spec["settings"]["checkpoint_interval"]))
            # The bare loop gets the environment the pipeline gave its rank (glibc's thresholds).
            out = run([PY, str(REPO / "bench" / "bare_loop.py"), str(RunDir(run_dir).run_json),
                       str(run_dir / "first_batch" / "rank0.safetensors"), str(OVERHEAD_STEPS)],
                      {**self.env, **launch_env(RunDir(run_dir).run_json)})
            self.memory.setdefault("bare PyTorch loop", []).append(out["max_rss_mib"])
            result = last_json(out["out"])
            bare.append(result["steady_step_s"])
            logged = metrics(run_dir)[0]["loss"]
            losses.append(abs(result["step1_loss"] - logged))
            threads.append((json.loads((run_dir / "timings.json").read_text()).get("threads"), result["threads"]))
        # The bare loop is only a baseline if it computes the same thing with the same threads.
        if max(losses) > 1e-5 or any(a != b for a, b in threads):
            raise SystemExit(f"bench: bare loop is not the pipeline's computation: step-1 |Δloss| {losses}, threads {threads}")
        ratios = [p / b for p, b in zip(pipeline, bare)]
        self.results["overhead"] = {"pipeline_step_s": summary(pipeline), "bare_step_s": summary(bare),
                                    "ratio": summary(ratios), "target_ratio": 1.05,
                                    "step1_loss_abs_diff": max(losses), "threads": threads[0][0]}

    # ---- time to first step ------------------------------------------------------------------

    def ttfs(self) -> None:
        from pipeline.models import registry

        splits: dict[str, dict[str, list[float]]] = {}
        for _ in range(self.repeats):
            for path in registry.names():
                started = time.time()
                result = run(["make", "--no-print-directory", f"train-{path}", "MODEL=tiny", "FRESH=1", "STEPS=1"], self.env)
                self.memory.setdefault(f"train {path} 2 ranks", []).append(result["max_rss_mib"])
                marks = json.loads((self.home("tiny").run(path).timings).read_text())
                parts = {"make → launcher starts torchrun": marks["launched"] - started,
                         "torchrun → rank entry": marks["entry"] - marks["launched"],
                         "imports": marks["imported"] - marks["entry"],
                         "config/model build": marks["built"] - marks["imported"],
                         "weight load": marks["loaded"] - marks["built"],
                         "step 1 (incl. data start)": marks["step1"] - marks["loaded"],
                         "total": marks["step1"] - started}
                for key, value in parts.items():
                    splits.setdefault(path, {}).setdefault(key, []).append(value)
        self.results["ttfs"] = {path: {k: summary(v) for k, v in parts.items()} for path, parts in splits.items()}
        self.results["ttfs_target_s"] = 8.0

    # ---- scaling -----------------------------------------------------------------------------

    def scaling(self) -> None:
        out = {}
        for compiled in (False, True):
            for ranks in (1, 2):
                first, steady_s = [], []
                for _ in range(self.repeats):
                    run_dir = self.train("--path", "native", "--steps", str(STEPS), "--nproc-per-node", str(ranks),
                                         "--config", self.config(compile=str(compiled).lower()),
                                         label=f"train native {ranks} rank{'s' if ranks > 1 else ''}{' compiled' if compiled else ''}")
                    first.append(metrics(run_dir)[0]["step_time_s"])
                    steady_s.append(steady(run_dir))
                out[f"{ranks} rank{'s' if ranks > 1 else ''}{', compile' if compiled else ', eager'}"] = {
                    "first_step_s": summary(first), "steady_step_s": summary(steady_s)}
        self.results["scaling"] = out

    # ---- export / verify ---------------------------------------------------------------------

    def export_and_verify(self, model: str, dtype: str, label: str) -> dict:
        """Export vs cp, and verify (first: the source's loss computed; then repeated) vs
        from_pretrained + one forward, alternating within each repeat, all in-process."""
        run_dir = self.home(model).run("native")
        inproc = "-m", "bench.inproc"
        exports, verifies, again, plains = [], [], [], []
        for _ in range(self.repeats):
            out = run([PY, *inproc, "export", model, "native", dtype], self.env)
            exports.append(last_json(out["out"]))
            run_dir.shared_reference_loss.unlink(missing_ok=True)
            plains.append(last_json(run([PY, *inproc, "plain", str(run_dir.export), str(run_dir.path)], self.env)["out"]))
            verifies.append(last_json(run([PY, *inproc, "verify", model, "native"], self.env)["out"]))
            again.append(last_json(run([PY, *inproc, "verify", model, "native"], self.env)["out"]))
        if not all(v["passed"] for v in verifies + again) or any(v["source_loss_cached"] for v in verifies) \
                or not all(v["source_loss_cached"] for v in again):
            raise SystemExit(f"bench: {label} verify did not run as measured: {verifies + again}")
        size = exports[0]["bytes"]
        peak = [e["rss_peak_gib"] - e["rss_before_gib"] for e in exports]
        return {
            "bytes": size, "dtype": dtype, "shards": exports[0]["shards"],
            "export_s": summary([e["export_s"] for e in exports]), "cp_s": summary([e["cp_s"] for e in exports]),
            "export_throughput_over_cp": summary([e["cp_s"] / e["export_s"] for e in exports]),
            "target_throughput_over_cp": 0.5,
            "export_MiB_per_s": summary([size / 2**20 / e["export_s"] for e in exports]),
            "export_peak_rss_above_imports_gib": summary(peak),
            "largest_tensor_gib": exports[0]["largest_tensor_bytes"] / GIB,
            "export_peak_over_largest_tensor": summary([p * GIB / exports[0]["largest_tensor_bytes"] for p in peak]),
            "from_pretrained_plus_forward_s": summary([p["plain_s"] for p in plains]),
            "verify_first_s": summary([v["verify_s"] for v in verifies]),
            "verify_repeat_s": summary([v["verify_s"] for v in again]),
            "verify_first_over_plain": summary([v["verify_s"] / p["plain_s"] for v, p in zip(verifies, plains)]),
            "verify_repeat_over_plain": summary([v["verify_s"] / p["plain_s"] for v, p in zip(again, plains)]),
            "target_verify_over_plain": 1.15,
            "verify_peak_rss_gib": summary([v["rss_peak_gib"] for v in verifies]),
            "plain_peak_rss_gib": summary([p["rss_peak_gib"] for p in plains]),
        }

    def export(self) -> None:
        run_dir = self.home("tiny").run("native")
        step = run_dir.latest_exportable_step() if run_dir.exists() else None
        # An earlier section's run (ttfs: 1 step, bfloat16) is not this one's: a float32 save of 5 steps.
        if step != 5 or run_dir.hf_weights_dtype(step) != "float32":
            self.train("--path", "native", "--steps", "5", "--export-dtype", "float32", label="train native 2 ranks")
        self.results["export"] = self.export_and_verify("tiny", "float32", "tiny")

    # ---- at a size that matters ----------------------------------------------------------------

    def size(self) -> None:
        from bench import hub_shaped
        from pipeline.training.memory import host_need
        from pipeline.training.resolve import RunRequest, resolve

        self.prepare("tiny")
        source = hub_shaped.make(self.root / "hub" / SIZE_MODEL, SIZE_MODEL, self.home("tiny").source_dir())
        model = str(source)
        self.prepare(model)
        out = {"model": SIZE_MODEL, "source_bytes": sum(p.stat().st_size for p in source.glob("*.safetensors"))}
        # Two runs, as memory allows (other users of this machine hold some): the CPU defaults (2
        # ranks), then, if that could not run, one rank, so export and verify have a checkpoint.
        for label, nproc in (("train_defaults", None), ("train_one_rank", 1)):
            spec = resolve(RunRequest(model=model, path="native", checkpoints_root=self.root,
                                      flags={"steps": 2, "nproc_per_node": nproc}))
            need = host_need(spec) / GIB * 1.3  # measured peaks run ~1.3x the estimate (bench results)
            available = mem_available_gib()
            if available < need:
                out[label] = {"skipped": f"{available:.1f} GiB available, {need:.1f} GiB wanted (1.3 × estimate)"}
                continue
            flags = ["--nproc-per-node", str(nproc)] if nproc else []
            result = self.pipe("train", "--model", model, "--path", "native", "--steps", "2", "--fresh", *flags,
                               label=f"train native {SIZE_MODEL} {spec.settings.nproc_per_node} rank(s)", check=False)
            run_dir = self.home(model).run("native")
            if result["code"] != 0:
                out[label] = {"failed": result["out"].strip().splitlines()[-1][:500]}
                continue
            record = json.loads(run_dir.memory.read_text())
            saves = [json.loads(line) for line in run_dir.saves.read_text().splitlines() if line.strip()]
            last = saves[-1]
            out[label] = {
                "settings": {k: getattr(spec.settings, k) for k in ("nproc_per_node", "seq_len", "local_batch_size", "dtype")},
                "peak_gib_per_rank": record["peak_gib_per_rank"], "estimate_gib_per_rank": record["estimate_gib_per_rank"],
                "peak_over_estimate": record["peak_over_estimate"], "target_peak_over_estimate": 2.0,
                "step_s": [m["step_time_s"] for m in metrics(run_dir.path)],
                # The last step: DCP (kept, so that more STEPS resume with the optimizer) + the HF save beside it.
                "checkpoint": {"saves": saves, "target_over_dcp": 1.1,
                               "last_save_time_over_dcp": (last["dcp_s"] + (last["hf_s"] or 0)) / last["dcp_s"],
                               "last_save_disk_over_dcp": (last["dcp_bytes"] + last["hf_bytes"]) / last["dcp_bytes"],
                               "bound_disk_over_dcp": 1 + 2 / (4 * 3)},
            }
            break
        if self.home(model).run("native").latest_exportable_step() is not None:
            out.update(self.export_and_verify(model, "bfloat16", SIZE_MODEL))
        self.results["size"] = out

    # ---- make pipeline -----------------------------------------------------------------------

    def pipeline(self) -> None:
        walls = []
        for _ in range(self.repeats):
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                result = run(["make", "--no-print-directory", "pipeline"], {**self.env, envvars.CHECKPOINTS: tmp})
            self.memory.setdefault("make pipeline", []).append(result["max_rss_mib"])
            walls.append(result["wall_s"])
        self.results["pipeline"] = {"wall_s": summary(walls), "target_s": 180}

    # ---- peers: TRL on the same work ---------------------------------------------------------

    def peers(self) -> None:
        from bench import hub_shaped
        from pipeline.data import dataset as sets
        from pipeline.run.rundir import RunDir

        self.prepare("tiny")
        name = f"{PEERS_MODEL}-{PEERS_OVERRIDES['num_hidden_layers']}L"
        source = hub_shaped.make(self.root / "hub" / name, PEERS_MODEL, self.home("tiny").source_dir(), PEERS_OVERRIDES)
        if not self.home(str(source)).is_downloaded():  # its data is tiny's chat and preference sets, not its own
            self.pipe("download", "--model", str(source))
        data = self.home("tiny").data_file.parent
        out = {"model": {"hub_config": PEERS_MODEL, **PEERS_OVERRIDES, "vocab_size": 151936},
               "settings": {"steps": PEERS_STEPS, "dtype": "float32", "nproc_per_node": 1},
               "same_rows_tolerance": PEERS_SAME_ROWS_TOLERANCE, "target_sft_ratio": 1.5}
        runs: dict[str, dict[str, list]] = {"sft": {"pipeline": [], "trl": []}, "dpo": {"pipeline": [], "trl": []}}
        for _ in range(self.repeats):
            for kind, dataset in (("sft", data / sets.CHAT_FILE), ("dpo", data / sets.PREFERENCE_FILE)):
                run_dir, rss = self.peer_pipeline(str(source), kind, dataset)
                runs[kind]["pipeline"].append({**peer_pipeline_figures(run_dir, kind), "max_rss_mib": rss})
                result = run([PY, "-m", "bench.peers", kind, str(RunDir(run_dir).run_json),
                              str(run_dir / "first_batch" / "rank0.safetensors"), str(PEERS_STEPS)],
                             {**self.env, **launch_env(RunDir(run_dir).run_json)})
                self.memory.setdefault(f"TRL {kind} ({name})", []).append(result["max_rss_mib"])
                runs[kind]["trl"].append({**last_json(result["out"]), "max_rss_mib": result["max_rss_mib"]})
        for kind, sides in runs.items():
            out[kind] = {"settings": PEERS_WORK[kind], **peer_comparison(kind, sides["pipeline"], sides["trl"])}
        run_dir = self.home(str(source)).run("peers-sft").path
        profiled = run([PY, "-m", "bench.peers", "profile", str(RunDir(run_dir).run_json),
                        str(run_dir / "first_batch" / "rank0.safetensors")], {**self.env, **launch_env(RunDir(run_dir).run_json)})
        out["sft"]["profile"] = last_json(profiled["out"])
        self.results["peers"] = out

    def peer_pipeline(self, model: str, kind: str, dataset: Path) -> tuple[Path, float]:
        import tomllib

        settings = tomllib.loads((REPO / "configs" / "finetune" / f"{kind}.toml").read_text())["train"]
        # No eval and no save inside the run: TRL does neither here, and neither is a training step.
        settings.update(steps=PEERS_STEPS, **PEERS_WORK[kind], dtype="float32", eval_every=0, checkpoint_interval=10 * PEERS_STEPS, dataset=str(dataset))
        config = self.root / f"peers-{kind}.toml"
        config.write_text("[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
        result = self.pipe("train", "--model", model, "--path", "native", "--fresh", "--name", f"peers-{kind}",
                           "--config", str(config), label=f"train native {kind} 1 rank (peers)")
        return self.home(model).run(f"peers-{kind}").path, result["max_rss_mib"]


def launch_env(run_json: Path) -> dict:
    """What the train stage put in the environment of this run's ranks."""
    from pipeline.run import targets
    from pipeline.run.spec import RunSpec
    from pipeline.training.memory import host_need

    spec = RunSpec.load(run_json)
    return targets.TARGETS[spec.target].launch_vars({}, host_need(spec))


def real_tokens(batch: dict, kind: str) -> int:
    """Tokens of a recorded batch that are not padding. SFT: the packed row segments (positions restart at 0) with a
    labelled token; the rest is the pad up to seq_len. DPO: each row up to its last labelled token (one row per
    side of a pair, padded to seq_len)."""
    total = 0
    for positions, labels in zip(batch["positions"], batch["labels"]):
        labelled = (labels != -100).nonzero().flatten()
        if kind == "dpo":
            total += int(labelled[-1]) + 1 if len(labelled) else 0
            continue
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        total += sum(b - a for a, b in zip(starts, starts[1:]) if (labels[a:b] != -100).any())
    return total


def peer_pipeline_figures(run_dir: Path, kind: str) -> dict:
    """A pipeline run's figures in the TRL side's terms: steady tokens/s counts real tokens only (the step computes
    on seq_len × batch; its first batch's share of real tokens stands for every step's)."""
    from safetensors.torch import load_file

    batch = load_file(str(run_dir / "first_batch" / "rank0.safetensors"))
    records = metrics(run_dir)
    computed, real = batch["input"].numel(), real_tokens(batch, kind)
    step_s = steady(run_dir, 10 * PEERS_STEPS)
    from pipeline.run.rundir import RunDir

    spec = json.loads(RunDir(run_dir).run_json.read_text())
    threads = json.loads((run_dir / "timings.json").read_text()).get("threads")
    return {"steady_step_s": step_s, "step_times_s": [m["step_time_s"] for m in records],
            "computed_tokens_per_step": computed, "real_tokens_step1": real, "packing_efficiency": real / computed,
            "steady_tokens_per_s": real / step_s, "steady_computed_tokens_per_s": computed / step_s,
            "labelled_tokens_step1": int((batch["labels"] != -100).sum()), "step1": records[0], "threads": threads,
            "attention_backend": spec["settings"]["attention_backend"]}


def peer_comparison(kind: str, pipeline: list[dict], trl: list[dict]) -> dict:
    threads = [(p["threads"], t["threads"]) for p, t in zip(pipeline, trl)]
    if any(a != b for a, b in threads):
        raise SystemExit(f"bench: TRL ran with other threads than the pipeline's rank: {threads}")
    out = {"pipeline_tokens_per_s": summary([p["steady_tokens_per_s"] for p in pipeline]),
           "trl_tokens_per_s": summary([t["steady_tokens_per_s"] for t in trl]),
           "ratio": summary([p["steady_tokens_per_s"] / t["steady_tokens_per_s"] for p, t in zip(pipeline, trl)]),
           "pipeline_step_s": summary([p["steady_step_s"] for p in pipeline]),
           "trl_step_s": summary([t["steady_step_s"] for t in trl]),
           "pipeline_peak_rss_mib": summary([p["max_rss_mib"] for p in pipeline]),
           "trl_peak_rss_mib": summary([t["max_rss_mib"] for t in trl]),
           "pipeline_step1_loss": pipeline[0]["step1"]["loss"], "trl_step1_loss": trl[0]["step1"]["loss"],
           "threads": threads[0][0], "pipeline": pipeline, "trl": trl}
    if kind == "sft":
        same = trl[0]["same_rows"]
        # The same conversations must be scored on both sides, or the step-1 comparison says nothing.
        if same["labelled_tokens"] != same["pipeline_labelled_tokens"]:
            raise SystemExit(f"bench: TRL's same-rows batch is not the pipeline's step-1 batch: {same}")
        out["same_rows_step1_loss_abs_diff"] = abs(same["loss"] - pipeline[0]["step1"]["loss"])
        out["packing_efficiency"] = {"pipeline_step1": pipeline[0]["packing_efficiency"], "trl": trl[0]["packing"]}
    else:
        # Both sides read the pairs in the pipeline's order: step 1 holds the same pairs, the policy is the reference.
        out["step1_logps_chosen"] = {"pipeline": pipeline[0]["step1"]["logps/chosen"], "trl": trl[0]["step1"]["logps/chosen"]}
        out["same_rows_step1_loss_abs_diff"] = abs(pipeline[0]["step1"]["loss"] - trl[0]["step1"]["loss"])
    out["same_rows_within_tolerance"] = out["same_rows_step1_loss_abs_diff"] <= PEERS_SAME_ROWS_TOLERANCE
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def steady(run_dir: Path, interval: int = 5) -> float:
    # Step 1 pays start-up; a step after a checkpoint save pays the save (logged with the next step).
    times = [m["step_time_s"] for m in metrics(run_dir) if m["step"] > 2 and (m["step"] - 1) % interval]
    return statistics.median(times)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def fmt(s: dict, unit: str = "s") -> str:
    return f"{s['median']:.3g} {unit} (spread {s['spread']:.2g}, n={s['n']})"


def table(results: dict) -> str:
    lines = [f"bench on {results['host']['cpus']} CPUs, torch {results['host']['torch']}, repeats {results['repeats']}"]
    if "overhead" in results:
        o = results["overhead"]
        lines += ["", "pipeline overhead (native, 1 rank, steady state):",
                  f"  pipeline step  {fmt(o['pipeline_step_s'])}", f"  bare loop step {fmt(o['bare_step_s'])}",
                  f"  ratio          {fmt(o['ratio'], '×')}  (target ≤ {o['target_ratio']})"]
    for path, parts in results.get("ttfs", {}).items():
        lines += ["", f"time to first step, train-{path} (make → step 1):"] + [f"  {k:34s} {fmt(v)}" for k, v in parts.items()]
    if "scaling" in results:
        lines += ["", "scaling (native):"] + [f"  {k:18s} first step {fmt(v['first_step_s'])}; steady {fmt(v['steady_step_s'])}"
                                              for k, v in results["scaling"].items()]
    for name, e in (("export (tiny)", results.get("export")), ("size (Qwen3-0.6B-shaped)", results.get("size"))):
        if not e:
            continue
        lines += ["", f"{name}:"]
        for label in ("train_defaults", "train_one_rank"):
            t = e.get(label)
            if t is None:
                continue
            if "peak_gib_per_rank" not in t:
                lines += [f"  {label}: {t}"]
                continue
            c = t["checkpoint"]
            lines += [f"  {label} {t['settings']}: peak/rank {t['peak_gib_per_rank']} GiB, "
                      f"{t['peak_over_estimate']:.2f}× the estimate ({t['estimate_gib_per_rank']['total']} GiB)",
                      f"  last save / DCP: time {c['last_save_time_over_dcp']:.2f}×, disk {c['last_save_disk_over_dcp']:.2f}×"]
        if "export_s" in e:
            lines += [f"  export {e['bytes'] / 2**20:.0f} MiB {e['dtype']}: {fmt(e['export_s'])}; cp {fmt(e['cp_s'])}; "
                      f"throughput/cp {fmt(e['export_throughput_over_cp'], '×')}",
                      f"  export peak RSS above imports {fmt(e['export_peak_rss_above_imports_gib'], 'GiB')} "
                      f"(largest tensor {e['largest_tensor_gib']:.2f} GiB)",
                      f"  verify first {fmt(e['verify_first_s'])}, repeated {fmt(e['verify_repeat_s'])}; "
                      f"from_pretrained + forward {fmt(e['from_pretrained_plus_forward_s'])}",
                      f"  verify/plain first {fmt(e['verify_first_over_plain'], '×')}, repeated {fmt(e['verify_repeat_over_plain'], '×')}"]
    if "pipeline" in results:
        lines += ["", f"make pipeline (tiny + tiny-moe, every path): {fmt(results['pipeline']['wall_s'])}"]
    peers = results.get("peers") or {}
    for kind in ("sft", "dpo"):
        e = peers.get(kind)
        if e:
            lines += ["", f"peers, {kind} ({peers['model']}, {peers['settings']}, {e['settings']}): real tokens/s",
                      f"  pipeline {fmt(e['pipeline_tokens_per_s'], 'tok/s')}; TRL {fmt(e['trl_tokens_per_s'], 'tok/s')}",
                      f"  ratio    {fmt(e['ratio'], '×')}; step-1 loss {e['pipeline_step1_loss']:.5f} vs {e['trl_step1_loss']:.5f}"
                      f" (same rows |Δ| {e['same_rows_step1_loss_abs_diff']:.2g}); peak RSS "
                      f"{fmt(e['pipeline_peak_rss_mib'], 'MiB')} vs {fmt(e['trl_peak_rss_mib'], 'MiB')}"]
    lines += ["", "peak memory (max RSS of the largest process of each stage):"]
    lines += [f"  {k:34s} {v['median']:.0f} MiB (spread {v['spread']:.0f}, n={v['n']})" for k, v in results["memory_mib"].items()]
    lines += ["", "sections measured at: " + ", ".join(f"{k} {v}" for k, v in results["measured_at"].items())]
    cuda = results.get("cuda")
    lines += ["", f"cuda: {json.dumps(cuda) if cuda else 'no GPU in this run; bench/cuda_check.sh is the prepared GPU check (not run here).'}"]
    return "\n".join(lines)


def main() -> int:
    repeats = int(os.environ.get("BENCH_REPEATS") or 3)
    if repeats < 2:
        print("error: BENCH_REPEATS must be at least 2 (a median and spread need repeats). Fix: set BENCH_REPEATS=2 or more.",
              file=sys.stderr)
        return 2
    only = [s for s in (os.environ.get("BENCH_ONLY") or ",".join(SECTIONS)).split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        print(f"error: unknown BENCH_ONLY sections {unknown}. Fix: pick from {','.join(SECTIONS)}.", file=sys.stderr)
        return 2
    root = Path(os.environ.get(envvars.CHECKPOINTS) or tempfile.mkdtemp(prefix="bench-"))
    bench = Bench(root, repeats)
    import torch

    started = time.time()
    bench.prepare()
    for section in only:
        print(f"bench: {section} …", flush=True)
        getattr(bench, section)()
    out = REPO / "bench" / "results.json"
    # Sections not run this time keep their earlier figures, each dated, so a slow section can be
    # measured on its own (BENCH_ONLY) without losing the others.
    previous = json.loads(out.read_text()) if out.exists() else {}
    if previous.get("schema") != SCHEMA:  # figures measured another way are not kept beside these
        previous = {}
    measured = {**previous.get("measured_at", {}), **{s: time.strftime("%Y-%m-%dT%H:%M:%S") for s in only}}
    kept = {k: previous[k] for k in (*SECTIONS, "ttfs_target_s", "cuda") if k in previous and k not in only
            and not (k == "ttfs_target_s" and "ttfs" in only)}
    memory = {**previous.get("memory_mib", {}), **{k: summary(v) for k, v in bench.memory.items()}}
    results = {"schema": SCHEMA, "host": {"cpus": os.cpu_count(), "torch": torch.__version__, "gpu": torch.cuda.is_available()},
               "repeats": repeats, "sections": only, "total_s": time.time() - started, "measured_at": measured,
               **kept, **bench.results, "memory_mib": memory}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out)
    print(table(results))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
