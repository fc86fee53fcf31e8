"""Prove an export is the model that was trained, and that it reloads.

Checks, in order (each becomes an entry of verify.json):
  files      the directory is a sound safetensors checkpoint (no pickle, index ↔ shards,
             no truncation, config.json agrees with every tensor's shape)
  manifest   every file's sha256 equals export's manifest.json
  load       transformers' AutoModelForCausalLM.from_pretrained (never remote code):
             zero missing, unexpected, mismatched keys and no load error
  keys / shapes / dtypes   the on-disk tensors against the reference (source) checkpoint
  finite     no NaN/Inf anywhere
  config / weights   with a run: config.json's architecture equals run.json's, and every tensor
             equals the run's saved weights of the exported step (pipeline/outputs/verify_run.py)
  round-trip an export of step 0 is bitwise equal to the source (cast to the export dtype);
  changed    an export after training steps differs from the source
  step1-loss-source   plain transformers' loss of the source on the recorded first batch
             equals the logged step-1 loss (each distinct batch computed once; the source's
             loss kept per model, runs/.reference_loss.json, for every path's verify), within
             the tolerance measured on the run's target; where none was measured (trn2 until
             configs/step1_tolerance.toml records one), reported in verify.json's "reported"
             and not gated
  step1-loss-expected the logged step-1 loss against configs/models.toml's expectation, only for a
             run made under the conditions it was measured under; otherwise verify.json's
             step1_expectation says "not comparable" and names the settings that differ
  step1-loss-export   for a step-0 export, the export's loss on that batch equals the logged
             step-1 loss (or the source's, when no step 1 was logged)

The batch: the run's first_batch; a STEPS=0 run records none, so the first batch of another
run of the same model and source is used (with that run's logged step-1 loss); failing that,
the first held-out corpus document tokenized by the reference tokenizer (then export and
source losses are compared with each other, and nothing is compared with a log).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline import console
from pipeline.flags import flag
from pipeline.checkpoint import hf_dir, manifest, stream
from pipeline.errors import Check, PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object
from pipeline.run.rundir import RunDir
from pipeline.dtypes import DTYPES, SAFETENSORS_CODES, by_code
from pipeline.outputs import verify_run

FALLBACK_TOKENS = 128


@dataclass(frozen=True)
class VerifyRequest:
    """What `make verify-checkpoint` asks for beyond a run's address (RunRef, whose export it verifies): an HF
    directory with the checkpoint it must match instead, and where the verdict goes. Its fields are the `verify`
    stage's flags (pipeline.flags) and Make variables (pipeline.host.makevars)."""

    checkpoint: Path | None = flag(None, "an HF checkpoint directory to verify (with --reference)", make="CHECKPOINT",
                                   make_help="verify-checkpoint: an HF directory to verify (with REFERENCE)")
    reference: Path | None = flag(None, "the checkpoint it must match (the downloaded source)", make="REFERENCE",
                                  make_help="verify-checkpoint: the checkpoint it must match")
    output: Path | None = flag(None, "where verify.json goes (default: the run dir / beside the checkpoint)")


@dataclass
class Batch:
    tensors: list[dict]
    origin: str
    logged: float | None
    run: RunDir | None = None  # the run that recorded it (and logged `logged`)


@dataclass
class Verification:
    checkpoint: Path
    reference: Path
    run_dir: Path | None
    output: Path
    checks: list[Check] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    step1_loss: dict = field(default_factory=lambda: {"export": None, "logged": None, "reference": None})
    expectation: dict | None = None  # configs/models.toml's step-1 expectation, and whether it applied
    reported: list[dict] = field(default_factory=list)  # measured and shown, not gated (no tolerance recorded)

    progress: object = None  # verify()'s tqdm bar over the checks (on a terminal): a big checkpoint's verify takes minutes

    def add(self, name: str, passed: bool, detail: str) -> bool:
        """Record a check (the table at the end shows it); the progress bar moves on."""
        self.checks.append(Check(name, bool(passed), detail))
        self._advance(name)
        return bool(passed)

    def report(self, name: str, detail: str, value: float) -> None:
        """A measurement verify shows and records but does not gate on."""
        self.reported.append({"name": name, "detail": detail, "value": value})
        self._advance(name)

    def _advance(self, name: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(name, refresh=False)
            self.progress.update(1)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "checkpoint": str(self.checkpoint),
            "reference": str(self.reference),
            "checks": [asdict(c) for c in self.checks],
            "missing_keys": self.missing_keys,
            "unexpected_keys": self.unexpected_keys,
            "mismatched_keys": self.mismatched_keys,
            "step1_loss": self.step1_loss,
            "step1_expectation": self.expectation,
            "reported": self.reported,
        }


def verify(checkpoint: Path, reference: Path, run_dir: RunDir | None, output: Path) -> Verification:
    import transformers

    # One progress bar per from_pretrained would bury the table and the one-line error.
    transformers.utils.logging.disable_progress_bar()
    from tqdm import tqdm

    result = Verification(checkpoint, reference, run_dir, output)
    if not console.brief():
        print(f"verifying {checkpoint} against {reference} …", flush=True)
    # disable=None: shown only where stderr is a terminal (a log file gets the table alone).
    result.progress = tqdm(desc="verify", unit=" checks", disable=None, leave=False)
    try:
        _run_checks(result)
    finally:
        result.progress.close()
        atomic_write_text(output, json.dumps(result.to_dict(), indent=2) + "\n")
        print_table(result)
    return result


def _run_checks(result: Verification) -> None:
    try:
        report = hf_dir.validate(result.checkpoint)
        ref_report = hf_dir.validate(result.reference)
    except PipelineError as err:
        result.add("files", False, err.problem)
        return  # unsafe or inconsistent on disk: nothing is loaded from it
    result.add("files", True, f"{len(report.tensors)} tensors in {len({t.shard for t in report.tensors.values()})} shards")
    # The manifest's hashes are computed while transformers loads the model (hashlib and file
    # reads release the GIL); the hashing also brings the shards into the page cache for the load.
    hashing = None
    if (result.checkpoint / manifest.MANIFEST).exists() or result.run_dir is not None:
        hashing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest").submit(
            manifest.check, result.checkpoint)
    model, load = _load(result)
    listed = None
    if hashing is not None:
        try:
            listed = hashing.result()
            result.add("manifest", True, f"{len(listed['files'])} files match their sha256")
        except PipelineError as err:
            result.add("manifest", False, err.problem)
    result.add("load", *load)
    _check_keys(result, report, ref_report)
    step = listed.get("step") if listed else None
    identical = _check_tensors(result, report, ref_report, step)
    if result.run_dir is not None and result.run_dir.exists():
        verify_run.check_config(result, report, result.run_dir)
        verify_run.check_weights(result, report, result.run_dir, step)
    _check_losses(result, step, report.tensors, model, identical)


def _load(result: Verification):
    """transformers' from_pretrained of the export, once: (the model or None, (passed, detail))."""
    import torch
    import transformers

    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(result.checkpoint), dtype=torch.float32, trust_remote_code=False, output_loading_info=True)
    except Exception as err:  # noqa: BLE001 - transformers 5 reports a missing MoE expert as a shape error
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, (False, f"from_pretrained raised {type(err).__name__}: {first[:300]}")
    result.missing_keys = sorted(info.get("missing_keys") or [])
    result.unexpected_keys = sorted(info.get("unexpected_keys") or [])
    result.mismatched_keys = sorted(str(m[0] if isinstance(m, (tuple, list)) else m) for m in info.get("mismatched_keys") or [])
    errors = [str(e) for e in info.get("error_msgs") or []]
    ok = not (result.missing_keys or result.unexpected_keys or result.mismatched_keys or errors)
    detail = (f"missing {len(result.missing_keys)}, unexpected {len(result.unexpected_keys)}, "
              f"mismatched {len(result.mismatched_keys)}, errors {len(errors)}"
              + (f": {(result.missing_keys + result.unexpected_keys + result.mismatched_keys + errors)[:3]}" if not ok else ""))
    return model.eval(), (ok, detail)


def _check_keys(result: Verification, report, ref_report) -> None:
    ours, theirs = report.tensors, ref_report.tensors
    tied = report.arch.tie_word_embeddings
    rule = ("tied embeddings: lm_head.weight is on disk exactly when the reference has it"
            if tied else "untied: lm_head.weight required on both")
    absent, extra = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    lm_head = f"lm_head.weight {'present' if 'lm_head.weight' in ours else 'absent'} (reference: " \
              f"{'present' if 'lm_head.weight' in theirs else 'absent'})"
    result.add("keys", not absent and not extra and tied == ref_report.arch.tie_word_embeddings,
               f"{len(ours)} keys vs {len(theirs)}; absent {absent[:3]}, extra {extra[:3]}; {lm_head}; {rule}")
    common = sorted(set(ours) & set(theirs))
    shapes = [k for k in common if ours[k].shape != theirs[k].shape]
    result.add("shapes", not shapes, f"{len(common) - len(shapes)}/{len(common)} identical"
                                     + (f"; differ: {shapes[:3]}" if shapes else ""))
    declared = _declared_dtype(result.checkpoint)
    ours_dtypes = {t.dtype for t in ours.values()}
    theirs_dtypes = {t.dtype for t in theirs.values()}
    result.add("dtypes", ours_dtypes == {declared} and len(theirs_dtypes) == 1,
               f"export {sorted(ours_dtypes)} (config.json dtype {declared}), reference {sorted(theirs_dtypes)}; "
               "every tensor must have the declared export dtype, the reference one uniform dtype")


def _declared_dtype(directory: Path) -> str:
    cfg = read_json_object(Path(directory) / "config.json", "re-run `make export … FORCE=1`.")
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return SAFETENSORS_CODES.get(name, name)


def _check_tensors(result: Verification, report, ref_report, step: int | None) -> bool:
    """Finite everywhere; step 0 bitwise equal to the source, later steps changed. True when every
    tensor is bitwise the source's in the source's own dtype (then so is every loss). Tensors are
    compared in place in the files' pages (pipeline.checkpoint.stream views), never copied."""
    import warnings

    import torch
    from tqdm import tqdm

    ours, theirs = _readers(result.checkpoint), _readers(result.reference)
    nonfinite, changed, unequal, total = [], [], [], 0
    size = sum(shard.stat().st_size for shard in hf_dir.shard_files(result.checkpoint))
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="comparing tensors",
               disable=size < stream.PROGRESS_MIN_BYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only map: only read here
        for key in sorted(set(ours) & set(theirs)):
            a = ours[key].view(key)
            bar.update(a.numel() * a.element_size())
            if a.is_floating_point() and not stream.finite(a):
                nonfinite.append(key)
            b = theirs[key].view(key)
            if a.shape != b.shape:
                continue
            total += 1
            if b.dtype != a.dtype:
                b = b.to(a.dtype)
            same_bits = torch.equal(a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
            if not same_bits:
                unequal.append(key)
                changed.append(key)
    bar.close()
    for reader in {id(r): r for r in (*ours.values(), *theirs.values())}.values():
        reader.close()
    result.add("finite", not nonfinite, "every tensor finite" if not nonfinite else f"NaN/Inf in {nonfinite[:5]}")
    if step == 0:
        result.add("round-trip", not unequal and total > 0,
                   f"step-0 export: {total - len(unequal)}/{total} tensors bitwise equal to the source (cast to the export dtype)"
                   + (f"; differ: {unequal[:3]}" if unequal else ""))
    elif step is not None:
        result.add("changed", bool(changed), f"step-{step} export: {len(changed)}/{total} tensors differ from the source")
    same_dtypes = {t.dtype for t in report.tensors.values()} == {t.dtype for t in ref_report.tensors.values()}
    return total > 0 and not unequal and total == len(report.tensors) == len(ref_report.tensors) and same_dtypes


def _readers(directory: Path) -> dict:
    """Tensor name → a reader of the shard holding it (the directory passed hf_dir.validate)."""
    from pipeline.checkpoint import stream

    readers = {}
    for shard in hf_dir.shard_files(directory):
        reader = stream.SafetensorsReader(shard)
        for key in reader.keys():
            readers[key] = reader
    return readers


def find_batch(run_dir: RunDir | None, reference: Path) -> Batch:
    """This run's first batch; else a sibling run's (same source); else a corpus document."""
    candidates = []
    if run_dir is not None:
        candidates.append(run_dir)
        candidates += sorted((RunDir(p) for p in run_dir.path.parent.iterdir() if p.is_dir() and p != run_dir.path),
                             key=lambda r: r.name)
    for candidate in candidates:
        if not candidate.first_batch.is_dir() or not candidate.exists():
            continue
        if Path(candidate.spec().source_dir).resolve() != Path(reference).resolve():
            continue
        origin = "this run's first batch" if candidate == run_dir else f"first batch of sibling run {candidate.name}"
        return Batch(candidate.first_batches(), origin, candidate.step1_token_loss(), candidate)
    return Batch([_corpus_batch(reference)], "first held-out corpus document (no recorded first batch)", None)


def _corpus_batch(reference: Path) -> dict:
    import torch
    import transformers

    from pipeline.checkpoint import corpus

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(reference), trust_remote_code=False)
    ids = tokenizer(corpus.held_out_documents()[0])["input_ids"][: FALLBACK_TOKENS + 1]
    ids = torch.tensor(ids).unsqueeze(0)
    return {"input": ids[:, :-1], "labels": ids[:, 1:], "positions": torch.arange(ids.shape[1] - 1).unsqueeze(0)}


def model_id(run_dir: RunDir | None, reference: Path) -> str | None:
    """The Hub id behind a verification: the run's MODEL, or an HF-cache snapshot path's repo."""
    if run_dir is not None:
        return run_dir.spec().model
    for part in Path(reference).resolve().parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def _check_expectation(result: Verification, batch: Batch) -> None:
    """The model's expected step-1 loss (configs/models.toml), compared only with a logged step-1
    loss of a run made under the conditions it was measured under; otherwise recorded as not
    comparable, naming why."""
    from pipeline.run import expectation

    expected = expectation.load(model_id(result.run_dir, result.reference))
    if expected is None:
        return
    record = {**expected.to_dict(), "measured": batch.logged, "comparable": False, "differing": {}}
    result.expectation = record
    if batch.logged is None or batch.run is None:
        print(f"  step1-loss-expected: not comparable  {expected.model}'s {expected.loss} is a logged step-1 loss, "
              f"and none was logged with {batch.origin}", flush=True)
        return
    comparison = expected.compare(batch.run.spec().settings)
    record["differing"] = {k: {"run": run, "expected": want} for k, (run, want) in comparison.differing.items()}
    caveats = "; ".join(filter(None, [
        f"unknown at the source, not compared: {', '.join(comparison.unknown)}" if comparison.unknown else "",
        f"assumed: {', '.join(comparison.assumed)}" if comparison.assumed else ""]))
    if not comparison.comparable:
        differing = ", ".join(f"{k} {run!r} ≠ {want!r}" for k, (run, want) in comparison.differing.items())
        print(f"  step1-loss-expected: not comparable  {expected.model}'s {expected.loss} was measured under other "
              f"settings: {differing} ({caveats}; configs/models.toml)", flush=True)
        return
    record["comparable"] = True
    diff = abs(batch.logged - expected.loss)
    result.add("step1-loss-expected", diff <= expected.tolerance,
               f"{expected.model}: logged step-1 loss {batch.logged:.4f} of run {batch.run.name} vs expected {expected.loss} ± {expected.tolerance} "
               f"under the same settings ({caveats}; configs/models.toml)")


def _check_losses(result: Verification, step: int | None, tensors, model, identical: bool) -> None:
    from pipeline.checkpoint.reference_loss import combine, distinct, loss_terms

    batch = find_batch(result.run_dir, result.reference)
    unique = distinct(batch.tensors)
    where = f"{batch.origin}, {len(batch.tensors)} file(s), {len(unique)} distinct"
    export_loss = combine([(loss_terms(model, b.tensors), b.copies) for b in unique]) if model is not None else math.nan
    del model
    if identical:
        # Bitwise the source's tensors in the source's dtype: the same model, the same loss.
        reference_loss, origin = export_loss, "= the export's: bitwise the source's weights"
    else:
        reference_loss, origin = _reference_loss(result, unique)
    result.step1_loss = {"export": export_loss, "logged": batch.logged, "reference": reference_loss}
    if batch.logged is not None:
        _check_logged_loss(result, reference_loss, batch.logged,
                           f"source (plain transformers, {origin}) {reference_loss:.6f} vs logged step-1 "
                           f"{batch.logged:.6f} on {where}")
    _check_expectation(result, batch)
    export_dtype = next(iter({t.dtype for t in tensors.values()}))
    tol = (by_code(export_dtype) or DTYPES["bfloat16"]).export_loss
    if step == 0 or step is None:
        target, what = (batch.logged, "logged step-1") if batch.logged is not None else (reference_loss, "source")
        diff = abs(export_loss - target)
        result.add("step1-loss-export", diff <= tol,
                   f"export {export_loss:.6f} vs {what} {target:.6f} on {where} ({export_dtype}): |diff| {diff:.2e} ≤ {tol:g}"
                   + ("" if step == 0 else "; export step unknown (no manifest), so it must equal the source"))
    else:
        result.add("step1-loss-export", math.isfinite(export_loss),
                   f"step-{step} export {export_loss:.6f} on {where} (source {reference_loss:.6f}): finite")


def _check_logged_loss(result: Verification, reference_loss: float, logged: float, what: str) -> None:
    """The logged step-1 loss against the source's, gated by the tolerance measured on the run's target
    (pipeline/outputs/tolerance.py); where none was measured, the difference is reported, not gated."""
    from pipeline.outputs import tolerance

    target, dtype = _training_target(result.run_dir), _training_dtype(result.run_dir)
    diff = abs(reference_loss - logged)
    recorded = tolerance.logged_loss(target, dtype)
    if recorded is None:
        result.report("step1-loss-source", f"{what}: |diff| {diff:.2e} (not gated: no tolerance measured on {target} "
                      f"in {dtype} yet; record one in {tolerance.TOLERANCE_FILE.name}, docs/trn2.md)", diff)
        return
    result.add("step1-loss-source", diff <= recorded.value,
               f"{what}: |diff| {diff:.2e} ≤ {recorded.value:g} ({target}, {dtype}: {recorded.basis})")


def _source_identity(reference: Path) -> dict:
    """What the source's loss depends on besides the batch: its files and the libraries computing it."""
    import torch
    import transformers

    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(Path(reference).iterdir())
             if p.is_file() and (p.suffix == ".safetensors" or p.name == "config.json")}
    return {"reference": str(Path(reference).resolve()), "files": files,
            "transformers": transformers.__version__, "torch": torch.__version__}


def _reference_loss(result: Verification, unique) -> tuple[float, str]:
    """The source's loss over the distinct batches. Each batch's (loss sum, tokens) is kept per
    model (runs/.reference_loss.json, seen by every path's run, which on one model and dataset
    record the same batches) under the source's identity and the batch's sha256: a model's source
    is computed once, whatever the number of paths and verifies."""
    from pipeline.checkpoint.reference_loss import combine, load_model, loss_terms

    cache = result.run_dir.shared_reference_loss if result.run_dir is not None else None
    identity = _source_identity(result.reference)
    known = _cached_terms(cache, identity)
    missing = [b for b in unique if b.digest not in known]
    if missing:
        source = load_model(result.reference)
        computed = {b.digest: list(loss_terms(source, b.tensors)) for b in missing}
        del source
        known |= computed
        if cache is not None:
            # Merged with what another verify (another path) wrote meanwhile; replaced atomically.
            atomic_write_text(cache, json.dumps({"source": identity,
                                                 "batches": _cached_terms(cache, identity) | computed}, indent=2) + "\n")
    loss = combine([(tuple(known[b.digest]), b.copies) for b in unique])
    if not missing:
        return loss, f"computed by an earlier verify, {cache.name}"
    reused = len(unique) - len(missing)
    return loss, "computed" + (f" ({reused} of {len(unique)} batches by an earlier verify, {cache.name})" if reused else "")


def _cached_terms(cache: Path | None, identity: dict) -> dict:
    if cache is None:
        return {}
    try:
        cached = read_json_object(cache, "none: the cache is only a shortcut.")
        if cached.get("source") == identity and isinstance(cached.get("batches"), dict):
            return dict(cached["batches"])
    except (OSError, ValueError, PipelineError):
        pass
    return {}


def _training_dtype(run_dir: RunDir | None) -> str:
    return run_dir.spec().settings.dtype if run_dir is not None and run_dir.exists() else "float32"


def _training_target(run_dir: RunDir | None) -> str:
    return run_dir.spec().target if run_dir is not None and run_dir.exists() else "cpu"


def print_table(result: Verification) -> None:
    """The checks, once; under `make pipeline` (console.brief) one line when all passed (its end table has the rest)."""
    losses = ", ".join(f"{k} {v:.6f}" if v is not None else f"{k} –" for k, v in result.step1_loss.items())
    if console.brief() and result.passed:
        print(f"verify: PASSED {len(result.checks)}/{len(result.checks)} checks (step-1 loss: {losses}) → {result.output}")
        return
    width = max((len(c.name) for c in result.checks), default=5)
    print(f"verify {result.checkpoint} against {result.reference}")
    for check in result.checks:
        print(f"  {check.name:<{width}}  {'pass' if check.passed else 'FAIL'}  {check.detail}")
    for entry in result.reported:
        print(f"  {entry['name']:<{width}}  report  {entry['detail']}")
    print(f"  step-1 loss: {losses}")
    print(f"{'PASSED' if result.passed else 'FAILED'} → {result.output}")
