"""`make bench`: the pipeline's costs measured side by side in one run on this machine.

Sections (BENCH_ONLY=a,b picks some; BENCH_REPEATS=n, n ≥ 2, repeats each measurement):
  overhead  steady-state step time of train-native (1 rank) vs a bare PyTorch loop, same model/batch/dtype/threads
  ttfs      time from `make train-<path>` to step 1, split into launch, imports, build, weight load, step
  scaling   1 vs 2 ranks, eager and torch.compile: first step and steady state
  export    export vs cp of the same bytes; verify vs a plain from_pretrained
  pipeline  `make pipeline` (the README command) on the embedded defaults, wall time
Every stage run is a child process; its max RSS (largest process of its tree) comes from wait4.
Prints a table and writes bench/results.json. Outputs go under PIPELINE_CHECKPOINTS (default a temp dir).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
SECTIONS = ("overhead", "ttfs", "scaling", "export", "pipeline")
STEPS = 12


def run(cmd: list[str], env: dict, cwd: Path = REPO) -> dict:
    """Run a child; wall time and max RSS of its process tree (ru_maxrss covers waited descendants)."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"start": start, "wall_s": time.time() - start, "max_rss_mib": usage.ru_maxrss / 1024, "out": out}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "spread": max(values) - min(values), "n": len(values), "samples": values}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def steady(run_dir: Path, interval: int = 5) -> float:
    # Step 1 pays start-up; a step after a checkpoint save pays the save (logged with the next step).
    times = [m["step_time_s"] for m in metrics(run_dir) if m["step"] > 2 and (m["step"] - 1) % interval]
    return statistics.median(times)


class Bench:
    def __init__(self, root: Path, repeats: int):
        self.root = root
        self.repeats = repeats
        self.env = {**os.environ, "PIPELINE_CHECKPOINTS": str(root), "MALLOC_MMAP_THRESHOLD_": "4294967296",
                    "MALLOC_TRIM_THRESHOLD_": "4294967296"}
        self.memory: dict[str, list[float]] = {}
        self.results: dict = {}

    def pipe(self, stage: str, *args: str, label: str | None = None) -> dict:
        result = run([PY, "-m", "pipeline", stage, *args], self.env)
        self.memory.setdefault(label or stage, []).append(result["max_rss_mib"])
        return result

    def train(self, *args: str, label: str) -> Path:
        self.pipe("train", "--model", "tiny", "--fresh", *args, label=label)
        return self.root / "tiny" / args[args.index("--path") + 1]

    def config(self, **changes) -> str:
        text = (REPO / "configs" / "cpu.toml").read_text()
        for key, value in changes.items():
            text = "\n".join(f"{key} = {value}" if line.startswith(f"{key} =") else line for line in text.splitlines())
        path = self.root / f"bench-{'-'.join(f'{k}{v}' for k, v in changes.items())}.toml"
        path.write_text(text + "\n")
        return str(path)

    def prepare(self) -> None:
        if not (self.root / "tiny" / "hf" / "config.json").exists():
            self.pipe("download", "--model", "tiny")
        if not (self.root / "tiny" / "data" / "train.jsonl").exists():
            self.pipe("data", "--model", "tiny")

    def overhead(self) -> None:
        pipeline, bare = [], []
        for _ in range(self.repeats):
            run_dir = self.train("--path", "native", "--steps", str(STEPS), "--nproc-per-node", "1", label="train native 1 rank")
            pipeline.append(steady(run_dir))
            out = run([PY, str(REPO / "bench" / "bare_loop.py"), str(self.root / "tiny" / "hf"),
                       str(run_dir / "first_batch" / "rank0.safetensors"), str(STEPS)], self.env)
            self.memory.setdefault("bare PyTorch loop", []).append(out["max_rss_mib"])
            bare.append(json.loads(out["out"].strip().splitlines()[-1])["steady_step_s"])
        ratios = [p / b for p, b in zip(pipeline, bare)]
        self.results["overhead"] = {"pipeline_step_s": summary(pipeline), "bare_step_s": summary(bare),
                                    "ratio": summary(ratios), "target_ratio": 1.10}

    def ttfs(self) -> None:
        out = {}
        for path in ("native", "hf", "nki"):
            splits: dict[str, list[float]] = {}
            for _ in range(self.repeats):
                started = time.time()
                result = run(["make", "--no-print-directory", f"train-{path}", "MODEL=tiny", "FRESH=1", "STEPS=1",
                              f"PY={PY}"], self.env)
                self.memory.setdefault(f"train {path} 2 ranks", []).append(result["max_rss_mib"])
                marks = json.loads((self.root / "tiny" / ("hf-run" if path == "hf" else path) / "timings.json").read_text())
                parts = {"launch (make → rank entry)": marks["entry"] - started,
                         "imports": marks["imported"] - marks["entry"],
                         "config/model build": marks["built"] - marks["imported"],
                         "weight load": marks["loaded"] - marks["built"],
                         "step 1 (incl. data start)": marks["step1"] - marks["loaded"],
                         "total": marks["step1"] - started}
                for key, value in parts.items():
                    splits.setdefault(key, []).append(value)
            out[path] = {k: summary(v) for k, v in splits.items()}
        self.results["ttfs"] = out

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

    def export(self) -> None:
        run_dir = self.root / "tiny" / "native"
        if not (run_dir / "run.json").exists():
            self.train("--path", "native", "--steps", "5", label="train native 2 ranks")
        export_s, cp_s, verify_s, plain_s = [], [], [], []
        for _ in range(self.repeats):
            export_s.append(self.pipe("export", "--model", "tiny", "--run", "native", "--force", "--dtype", "fp32")["wall_s"])
            files = sorted((run_dir / "export").glob("*.safetensors"))
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                cp_s.append(run(["cp", *map(str, files), tmp], self.env)["wall_s"])
            verify_s.append(self.pipe("verify", "--model", "tiny", "--run", "native")["wall_s"])
            plain = run([PY, "-c", "import sys; from transformers import AutoModelForCausalLM; "
                         "AutoModelForCausalLM.from_pretrained(sys.argv[1])", str(run_dir / "export")], self.env)
            self.memory.setdefault("plain from_pretrained", []).append(plain["max_rss_mib"])
            plain_s.append(plain["wall_s"])
        size = sum(p.stat().st_size for p in (run_dir / "export").glob("*.safetensors"))
        self.results["export"] = {"bytes": size, "export_s": summary(export_s), "cp_s": summary(cp_s),
                                  "export_over_cp": summary([e / c for e, c in zip(export_s, cp_s)]),
                                  "export_MiB_per_s": summary([size / 2**20 / e for e in export_s]),
                                  "verify_s": summary(verify_s), "from_pretrained_s": summary(plain_s),
                                  "verify_over_from_pretrained": summary([v / p for v, p in zip(verify_s, plain_s)])}

    def pipeline(self) -> None:
        walls = []
        for _ in range(self.repeats):
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                result = run(["make", "--no-print-directory", "pipeline", f"PY={PY}"], {**self.env, "PIPELINE_CHECKPOINTS": tmp})
            self.memory.setdefault("make pipeline", []).append(result["max_rss_mib"])
            walls.append(result["wall_s"])
        self.results["pipeline"] = {"wall_s": summary(walls)}


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
        lines += ["", f"time to first step, train-{path} (make → step 1):"] + [f"  {k:28s} {fmt(v)}" for k, v in parts.items()]
    if "scaling" in results:
        lines += ["", "scaling (native):"] + [f"  {k:18s} first step {fmt(v['first_step_s'])}; steady {fmt(v['steady_step_s'])}"
                                              for k, v in results["scaling"].items()]
    if "export" in results:
        e = results["export"]
        lines += ["", f"export ({e['bytes'] / 2**20:.1f} MiB fp32):", f"  export          {fmt(e['export_s'])}",
                  f"  cp same bytes   {fmt(e['cp_s'])}", f"  export / cp     {fmt(e['export_over_cp'], '×')}",
                  f"  verify          {fmt(e['verify_s'])}", f"  from_pretrained {fmt(e['from_pretrained_s'])}",
                  f"  verify / f_p    {fmt(e['verify_over_from_pretrained'], '×')}"]
    if "pipeline" in results:
        lines += ["", f"make pipeline (tiny + tiny-moe, every path): {fmt(results['pipeline']['wall_s'])}"]
    lines += ["", "peak memory (max RSS of the largest process of each stage):"]
    lines += [f"  {k:28s} {v['median']:.0f} MiB (spread {v['spread']:.0f}, n={v['n']})" for k, v in results["memory_mib"].items()]
    lines += ["", "sections measured at: " + ", ".join(f"{k} {v}" for k, v in results["measured_at"].items())]
    lines += ["", "cuda: no GPU in this run; bench/cuda_check.sh is the prepared GPU check (not run here)."]
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
    root = Path(os.environ.get("PIPELINE_CHECKPOINTS") or tempfile.mkdtemp(prefix="bench-"))
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
    measured = {**previous.get("measured_at", {}), **{s: time.strftime("%Y-%m-%dT%H:%M:%S") for s in only}}
    kept = {s: previous[s] for s in SECTIONS if s in previous and s not in only}
    memory = {**previous.get("memory_mib", {}), **{k: summary(v) for k, v in bench.memory.items()}}
    results = {"host": {"cpus": os.cpu_count(), "torch": torch.__version__, "gpu": torch.cuda.is_available()},
               "repeats": repeats, "sections": only, "total_s": time.time() - started, "measured_at": measured,
               **kept, **bench.results, "memory_mib": memory}
    text = table(results)
    print(text)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
