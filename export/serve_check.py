"""`draftsmith serve-check`: the export judged by the engine that serves it — vLLM, run here.

vLLM lives in its own environment (`make setup-vllm` -> .venv-vllm; it pins another transformers), so it is
never imported here: each engine is a child process running export/vllm_run.py under .venv-vllm's python
(found, with the environment it runs in, by data/engines/vllm_server.py), given a job JSON and writing a
result JSON. The child runs in its own process group and is killed with it after `timeout` seconds (vLLM
spawns an engine-core process that would otherwise outlive it).

One check, on the same prompts (chat-templated to token ids here, so both engines read the same ids):

    1. vLLM without speculation: the reference greedy output and the plain tokens/s;
    2. vLLM with the export as its speculator: loaded (or vLLM's own error line), output identical to (1),
       per-position acceptance, α and τ from vLLM's spec-decode counters, tokens/s at batch 1 and batch N;
    3. draftsmith's evaluator on the same prompts in vLLM's shape (`--as-served vllm`: the method alone, its chain
       or block of k, greedy drafts, vLLM's n-gram matching), on the weights read back from the export
       (`import_export`, into the report folder), so both decoders draft from the same tensors.

The report folder (default runs/serve-check/EXPORT_NAME) holds report.json, report.md, each engine's job,
result and log; only the model card's "Served by vLLM" section is written into the export.

vLLM's counters: num_drafts (steps that proposed), num_draft_tokens, num_accepted_tokens and
num_accepted_tokens_per_pos[d] (steps whose first d+1 draft tokens were all accepted). So
per-position acceptance[d] = per_pos[d] / num_drafts, α = accepted / draft tokens and
τ = 1 + accepted / num_drafts (the bonus token included) — the quantities draftsmith's report defines, as long
as every step drafts (a model drafter). A step that proposes nothing (n-gram lookup without a match) is no
draft to vLLM, so its τ is per drafting step while draftsmith's is per target forward.

Where the two decoders differ (measured): draftsmith never proposes past the token budget (at most
remaining - 1 tokens), vLLM drafts k at the last step too and counts what the target accepts there. On short
outputs the last step weighs: a tiny Medusa at 24 new tokens differed by 0.035 at position 3, at 64 by 0.006.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from draftsmith import schema
from draftsmith.data.engines.vllm_server import ServeCheckError, vllm_env, vllm_python
from draftsmith.errors import ConfigError, show
from draftsmith.export.vllm import formats as vllm_formats
from draftsmith.formatting import fmt_num, md_cell
from draftsmith.layouts.common import read_guard
from draftsmith.layouts.serving import VllmServe
from draftsmith.outputs import atomic_write_json, atomic_write_text, open_output
from draftsmith.reading import read_json

RUNNER = Path(__file__).with_name("vllm_run.py")
# How vLLM serves each export format (its speculative method, a chain length it would serve otherwise than trained,
# the fixes of vLLM's CPU kernels the runner applies: a file of the method's folder the runner loads by path,
# each a measured defect, applied only on the CPU platform; the report lists what was applied) is each
# method's own: `Method.serving`, read through export/vllm.py
TOLERANCE = 0.03  # per-position acceptance, vLLM vs draftsmith, absolute (float32 vs float32 kernels differ)


def speculative_config(export_dir: Path | None, k: int, method: str | None = None) -> dict:
    """vLLM's speculative_config for an export (its format in draftsmith.json names the method), or the
    n-gram control (method="ngram": prompt lookup with draftsmith's n-gram sizes, 1..3)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    entry = vllm_serving(export_dir)
    problem = entry.check(export_dir, k) if entry.check is not None else None
    if problem:
        raise ConfigError(problem)
    return {"method": entry.method, "model": str(export_dir.resolve()), "num_speculative_tokens": k}


def vllm_serving(export_dir: Path) -> VllmServe:
    """How vLLM serves this export, by its format in draftsmith.json (each method declares its own)."""
    fmt = read_guard(export_dir).get("format")
    known = vllm_formats()
    if fmt not in known:
        raise ConfigError(f"{export_dir / 'draftsmith.json'}: format '{fmt}' is not a vLLM export "
                          f"(vLLM reads {', '.join(known)})")
    return known[fmt]


def run_vllm(job: dict, workdir: Path, name: str, timeout: float) -> dict:
    """One engine in the vLLM environment; its log is kept beside the result (workdir/NAME.log)."""
    python = vllm_python()
    job_path, result_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job.json", "result.json", "log"))
    atomic_write_json(job_path, job)
    result_path.unlink(missing_ok=True)
    env = vllm_env()
    with open_output(log_path) as log:  # never through a link planted at the log's name
        proc = subprocess.Popen([str(python), str(RUNNER), str(job_path), str(result_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:  # the runner exits without waiting on vLLM's engine core: take the whole group down
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if not result_path.is_file():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise ServeCheckError(f"vLLM run '{name}' gave no result within {timeout:.0f} s "
                              f"(log {log_path}: {tail[0][:300]})")
    result = read_result(result_path, log_path, len(job.get("prompts") or []))
    if result.get("error") and (ENGINE_WRAPPER in result["error"] or "failed to be inspected" in result["error"]):
        # the engine core failed in its own process: its log holds the cause, the runner only vLLM's wrapper
        cause = root_cause(log_path)
        if cause:
            result["error"], result["error_wrapper"] = cause, result["error"]
    if result.get("error"):  # vLLM's own line often points at a stack trace ("see above") only its log holds
        result["error"] = f"{result['error']} (stack trace in the vLLM log {log_path})"
    return result


RESULT_MAX_BYTES = 256 << 20  # the outputs of every prompt, twice, as token ids: a few MB on the largest sets


def read_result(path: Path, log_path: Path, prompts: int | None = None) -> dict:
    """The one reader of a vLLM result file (export/vllm_run.py writes it): every field serve-check reads,
    typed, or a ServeCheckError naming the file, the field and the engine's log. `prompts`: how many prompts the
    job gave vLLM (None: a stored result read without its job); a loaded engine must have decoded exactly one
    output per prompt, one at a time and batched, and there must be at least one: two empty lists compare equal,
    and a check that compared nothing would pass as lossless (and the retrain gate promote on it)."""
    try:
        result = schema.read_doc(path, max_bytes=RESULT_MAX_BYTES)
        schema.get(result, "loaded", path, "bool", null=True)
        for name in ("error", "vllm_version"):
            schema.get(result, name, path, "str", null=True, default=None)
        schema.get(result, "patches", path, "list", null=True, default=None)
        if result["loaded"]:
            _token_lists(result, "outputs", path)
            counters = schema.get(result, "counters", path, "dict")
            for name in counters:  # a count per draft position (`..._per_pos`), else one count
                schema.get(counters, name, f"{path}: field 'counters'", "numbers" if name.endswith("_per_pos")
                           else "number", lo=0)
            for run in ("batch1", "batched"):
                schema.get(result, f"{run}.tokens", path, "int", lo=0)
                schema.get(result, f"{run}.seconds", path, "number", lo=0)
                schema.get(result, f"{run}.tokens_per_s", path, "number", lo=0, null=True)
            schema.get(result, "batched.batch", path, "int", lo=1)
            _token_lists(result, "batched.outputs", path)
            for name, outputs in (("outputs", result["outputs"]), ("batched.outputs", result["batched"]["outputs"])):
                if prompts is not None and (len(outputs) != prompts or prompts < 1):
                    raise schema.FieldError(f"{path}: field '{name}' holds {len(outputs)} outputs for {prompts} "
                                            f"prompt{'' if prompts == 1 else 's'}: vLLM must decode one output per "
                                            "prompt, else there is nothing to judge; refused")
    except schema.FieldError as e:
        raise ServeCheckError(f"{e} (vLLM log {log_path})") from None
    return result


def _token_lists(result: dict, name: str, path: Path) -> None:
    """`name` is a list of token-id lists (one generation per prompt)."""
    outputs = schema.get(result, name, path, "list")
    bad = next((i for i, o in enumerate(outputs) if not isinstance(o, list)
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in o)), None)
    if bad is not None:
        raise schema.FieldError(f"{path}: field '{name}' item {bad} is {show(outputs[bad])}, expected a list of "
                                "token ids")


ENGINE_WRAPPER = "Engine core initialization failed"
_CAUSE = re.compile(r"\b((?:[A-Z]\w*(?:Error|Exception))|NotImplementedError|AssertionError): (.+)$")


def root_cause(log_path: Path) -> str | None:
    """The reason a vLLM engine did not start, from its log: a module it could not import (vLLM inspects a model
    class in a subprocess and reports only that inspection failed), else the first exception line a child process
    logged (`ERROR ... RuntimeError: ...`) that is not vLLM's own wrapper around another."""
    causes = []
    for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _CAUSE.search(line)
        if m and ENGINE_WRAPPER not in line and "Worker failed with error" not in line:
            causes.append(f"{m[1]}: {m[2].strip()}"[:500])
    missing = [c for c in causes if c.startswith(("ModuleNotFoundError", "ImportError"))]
    return (missing or causes or [None])[0]


def vllm_acceptance(counters: dict, k: int) -> dict:
    drafts = counters.get("spec_decode_num_drafts") or 0
    accepted = counters.get("spec_decode_num_accepted_tokens") or 0
    proposed = counters.get("spec_decode_num_draft_tokens") or 0
    per_pos = (counters.get("spec_decode_num_accepted_tokens_per_pos") or [0] * k)[:k]
    return {"num_drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "per_position_acceptance": [p / drafts if drafts else None for p in per_pos],
            "alpha": accepted / proposed if proposed else None, "tau": 1 + accepted / drafts if drafts else None}


def draftsmith_side(export_dir: Path | None, target, files: list[str], k: int, max_new_tokens: int,
                    limit: int | None, seed: int, method: str | None, workdir: Path,
                    adaptive: bool = False) -> tuple[dict, str]:
    """draftsmith's evaluator in vLLM's shape at k (`--as-served vllm`), float32 drafts (vLLM upcasts a bf16 drafter
    to a float32 target), on the weights read back from the export. Returns (overall summary with its `shape`,
    proposer spec)."""
    from draftsmith.evaluation.evaluate import evaluate

    if method == "ngram":
        proposer = "ngram:3"
    else:
        entry = vllm_serving(export_dir)
        if entry.proposer is not None:
            proposer = entry.proposer(export_dir)
        else:
            from draftsmith.export.api import import_export

            art = import_export(export_dir, workdir / "reimported", overwrite=True)
            proposer = f"{read_json(art / 'manifest.json')['kind']}:{art}"
    # acceptance is what is compared with vLLM's counters: one timed run a prompt; HF generate stays on, as the
    # independent reference draftsmith's `lossless` is judged against. vLLM decodes each prompt's first user
    # turn (`_job`), so the evaluator does too: a multi-turn prompt's later turns would add generations vLLM
    # never ran to one side of the comparison
    # decoded in vLLM's own shape (decoding/served_shape.py: the method alone, its chain or block of k, greedy
    # drafts, vLLM's n-gram matching), adaptive verification only where the speculative config asks vLLM for it
    report = evaluate(target, proposer, prompts=files, k=k, max_new_tokens=max_new_tokens, limit_per_domain=limit,
                      seed=seed, cost_model=False, draft_dtype="float32", repeats=1, remeasure=0, turns="first",
                      as_served="vllm", as_served_options={"adaptive_verification": adaptive},
                      out=str(workdir / "draftsmith-eval"))
    return {**report["overall"], "shape": report["shape"]}, proposer


def serve_check(export_dir: str | Path | None, target, prompts: list[str] | None = None, out: str | Path | None = None,
                k: int = 4, max_new_tokens: int = 64, limit_per_domain: int | None = 2, batch: int | None = None,
                seed: int = 0, timeout: float = 900.0, method: str | None = None, evaluate: bool = True,
                plain: dict | None = None, card: bool = True, patches: bool = True) -> dict:
    """Run the check and write report.json + report.md into `out` (default: runs/serve-check/EXPORT_NAME). `method`
    "ngram" checks vLLM's n-gram lookup instead of an export (the control). `plain`: a vLLM result without
    speculation already measured on these prompts (tests share one per target). `patches`: apply the runner's
    fixes of vLLM's CPU kernels for this export's format (`VllmServe.patches`); False runs vLLM exactly as
    installed. Returns the report."""
    export_dir, target, spec, files, out, job = _job(export_dir, target, prompts, out, k, max_new_tokens,
                                                     limit_per_domain, batch, seed, method)
    t0 = time.perf_counter()
    if plain is None:
        plain = run_vllm({**job, "speculative_config": None}, out, "vllm-plain", timeout)
    if not plain.get("loaded"):
        raise ServeCheckError(f"vLLM did not run the target {target.folder} itself: {plain.get('error')}")
    fixes = ([{"name": p.name, "file": str(p.file.resolve())} for p in vllm_serving(export_dir).patches]
             if patches and export_dir is not None else [])
    spec_run = run_vllm({**job, "speculative_config": spec, "patches": fixes}, out, "vllm-spec", timeout)
    report = {"export": str(export_dir) if export_dir else None, "target": str(target.folder), "method": spec["method"],
              "k": k, "n_prompts": len(job["prompts"]), "max_new_tokens": max_new_tokens, "prompt_files": files,
              "vllm_version": spec_run.get("vllm_version"), "speculative_config": spec,
              "loaded": bool(spec_run.get("loaded")),
              "error": spec_run.get("error"), "plain": _speed(plain), "vllm_patches": spec_run.get("patches") or []}
    if report["loaded"]:
        _compare_runs(report, spec_run, plain, k)
        if evaluate:
            _beside_draftsmith(report, export_dir, target, files, k, max_new_tokens, limit_per_domain, seed, method,
                               out)
    report["wall_seconds"] = time.perf_counter() - t0
    report["note"] = ("tokens/s were measured on a machine that may be shared with other jobs: indicative only; "
                      "acceptance and losslessness do not depend on load")
    atomic_write_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render(report))
    if card and export_dir is not None and report["loaded"] and (export_dir / "README.md").is_file():
        add_to_card(export_dir / "README.md", report)
    return report


def _job(export_dir, target, prompts: list[str] | None, out, k: int, max_new_tokens: int,
         limit_per_domain: int | None, batch: int | None, seed: int, method: str | None) -> tuple:
    """The arguments checked and the vLLM job both runs share: (export_dir, target, speculative config, prompt
    files, report folder (created), job without its speculative config)."""
    from draftsmith.evaluation.domains import default_prompt_files, format_prompt, load_prompts
    from draftsmith.targets import load_target

    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    export_dir = Path(export_dir) if export_dir is not None else None
    if export_dir is None and method != "ngram":
        raise ConfigError("serve-check needs --export DIR (or --ngram for vLLM's n-gram control)")
    if isinstance(target, str):
        target = load_target(target)
    if target.folder is None:
        raise ConfigError(f"target {target.name}: vLLM needs an HF folder of the target (load it from a folder, a "
                          f"GGUF or an embedded name)")
    spec = speculative_config(export_dir, k, method)
    files = list(prompts or [str(p) for p in default_prompt_files()])
    rows = load_prompts(files, limit_per_domain, seed)
    ids = [format_prompt(target.tokenizer, r.text) for r in rows]
    if not ids:
        raise ConfigError(f"serve-check: no prompt in {', '.join(files)}: vLLM would decode nothing to compare")
    # beside the export, never in it: the export folder uploads as is, and the check's files are no part of it
    out = Path(out) if out is not None else Path("runs/serve-check") / (export_dir.name if export_dir else "ngram")
    if export_dir is not None and out.resolve().is_relative_to(export_dir.resolve()):
        raise ConfigError(f"{out}: the report folder lies inside the export {export_dir}, which uploads as is")
    out.mkdir(parents=True, exist_ok=True)
    longest = max(len(i) for i in ids) + max_new_tokens + k + 8
    limit = getattr(target.text_config, "max_position_embeddings", None) or longest
    if longest > limit:
        raise ConfigError(f"prompts of up to {longest - max_new_tokens - k - 8} tokens + {max_new_tokens} new "
                          f"exceed the target's max_position_embeddings {limit}")
    job = {"target": str(target.folder), "dtype": "float32", "prompts": ids, "max_new_tokens": max_new_tokens,
           "batch": batch or len(ids), "seed": seed, "max_model_len": min(max(512, longest), limit)}
    return export_dir, target, spec, files, out, job


def _compare_runs(report: dict, spec_run: dict, plain: dict, k: int) -> None:
    """vLLM with the export against vLLM alone: lossless one at a time and batched, vLLM's acceptance, speeds."""
    same = spec_run["outputs"] == plain["outputs"]
    first_diff = next((i for i, (a, b) in enumerate(zip(spec_run["outputs"], plain["outputs"])) if a != b), None)
    report.update(
        lossless=same and spec_run["batched"]["outputs"] == plain["outputs"],
        lossless_batch1=same, lossless_batched=spec_run["batched"]["outputs"] == plain["outputs"],
        first_differing_prompt=first_diff, vllm=vllm_acceptance(spec_run["counters"], k),
        speculative=_speed(spec_run))
    for n in ("batch1", "batched"):
        base, sp = report["plain"][n]["tokens_per_s"], report["speculative"][n]["tokens_per_s"]
        report["speculative"][n]["speedup"] = sp / base if sp and base else None


def _beside_draftsmith(report: dict, export_dir: Path | None, target, files: list[str], k: int, max_new_tokens: int,
                       limit_per_domain: int | None, seed: int, method: str | None, out: Path) -> None:
    """draftsmith's own evaluator on the same prompts: its per-position acceptance beside vLLM's."""
    adaptive = bool(report["speculative_config"].get("enable_adaptive_verification"))
    overall, proposer = draftsmith_side(export_dir, target, files, k, max_new_tokens, limit_per_domain, seed,
                                        method, out, adaptive)
    ds = {"proposer": proposer, "shape": overall["shape"],
          "per_position_acceptance": overall.get("per_position_acceptance"), "alpha": overall.get("alpha"),
          "tau": overall.get("tau"), "lossless": overall.get("lossless")}
    report["draftsmith"] = ds
    report["per_position_difference"] = [
        abs(a - b) if a is not None and b is not None else None
        for a, b in zip(report["vllm"]["per_position_acceptance"], ds["per_position_acceptance"] or [])]
    diffs = [d for d in report["per_position_difference"] if d is not None]
    report["acceptance_matches"] = bool(diffs) and max(diffs) <= TOLERANCE
    report["tolerance"] = TOLERANCE


def _speed(r: dict) -> dict:
    return {"batch1": {k: r["batch1"][k] for k in ("tokens", "seconds", "tokens_per_s")},
            "batched": {k: r["batched"][k] for k in ("batch", "tokens", "seconds", "tokens_per_s")}}


def render(r: dict, heading: str = "#") -> str:
    lines = [f"{heading} Served by vLLM {r.get('vllm_version') or ''}".rstrip(), "",
             f"`{md_cell(json.dumps(r['speculative_config']))}` on `{md_cell(r['target'])}`, "
             f"{r['n_prompts']} prompts, greedy, "
             f"up to {r['max_new_tokens']} new tokens, chain of {r['k']}.", ""]
    if not r["loaded"]:
        return "\n".join(lines + [f"**Not loaded.** vLLM: `{md_cell(r['error'])}`", ""])
    v, d = r["vllm"], r.get("draftsmith") or {}
    lines += [f"- loaded: yes; output identical to vLLM without speculation: "
              f"{'yes' if r['lossless'] else 'NO'} (one at a time and batched)"]
    lines += [f"- vLLM run with a fix of its CPU kernels: {md_cell(p)}"
              for p in r.get("vllm_patches") or []] + [""]
    ppa_v = " / ".join(fmt_num(x) for x in v["per_position_acceptance"])
    lines += ["| decoder | per-position acceptance | α | τ |", "|---|---|---|---|",
              f"| vLLM (its spec-decode counters) | {ppa_v} | {fmt_num(v['alpha'])} | {fmt_num(v['tau'])} |"]
    if d:
        ppa_d = " / ".join(fmt_num(x) for x in d["per_position_acceptance"] or [])
        shape = (d.get("shape") or {}).get("label") or f"k={r['k']}"
        lines.append(f"| draftsmith evaluate --as-served vllm ({md_cell(shape)}), same prompts | {ppa_d} | "
                     f"{fmt_num(d['alpha'])} "
                     f"| {fmt_num(d['tau'])} |")
    lines.append("")
    p, s = r["plain"], r["speculative"]
    lines += ["| tokens/s | without speculation | with | speedup |", "|---|---|---|---|",
              f"| batch 1 | {fmt_num(p['batch1']['tokens_per_s'], '.1f')} "
              f"| {fmt_num(s['batch1']['tokens_per_s'], '.1f')} | "
              f"{fmt_num(s['batch1'].get('speedup'), '.2f')} |",
              f"| batch {s['batched']['batch']} | {fmt_num(p['batched']['tokens_per_s'], '.1f')} | "
              f"{fmt_num(s['batched']['tokens_per_s'], '.1f')} | {fmt_num(s['batched'].get('speedup'), '.2f')} |", "",
              r["note"] + ".", ""]
    return "\n".join(lines)


def add_to_card(card: Path, report: dict) -> None:
    """Put the vLLM figures into the export's model card, replacing an earlier serve-check section."""
    text = card.read_text(encoding="utf-8")
    marker = "## Served by vLLM"
    if marker in text:
        head, _, rest = text.partition(marker)
        nxt = rest.find("\n## ")
        text = head + (rest[nxt + 1:] if nxt >= 0 else "")
    atomic_write_text(card, text.rstrip() + "\n\n" + render(report, "##"))
