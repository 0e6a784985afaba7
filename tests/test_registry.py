"""Adding a drafting method is one registration: a toy method, declared here and nowhere else, is trained
by `draftsmith train`, loaded by the config loader, accepted as an artifact kind, decoded losslessly by
the verifier and evaluated, exported in layouts of its own (serve.md, the vLLM method serve-check hands vLLM and the
vLLM refusal an export warns of are its own too, with no edit of export/), and known to retrain, bench and plan.

The toy drafts from a next-token table: entry t is the target's greedy token after the one-token context
t. Its job (a `training.job.Job`, trained by the one runner like every method's) learns the table's logits
against those tokens, read off the target in one batched forward. Its proposal is the chain the table
spells from the pending token."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from draftsmith import artifact, methods
from draftsmith.checks import inspect_artifact
from draftsmith.config import CONFIG_KINDS, load_config, to_dict
from draftsmith.decoding.proposer import Proposal, Proposer
from draftsmith.errors import ArtifactError, ConfigError
from draftsmith.training.config import EvalAfterTraining, TrainConfig
from draftsmith.training.job import Job


@dataclass
class TableConfig:
    target: str = ""
    data: str = ""  # unused: the table is read off the target itself
    output: str = ""
    # two steps over every context at once: Adam's first step already puts each row's mass on its label
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=0.5, max_steps=2, batch_size=256,
                                                                   schedule="constant", progress=False))
    evaluate: EvalAfterTraining = field(default_factory=lambda: EvalAfterTraining(enabled=False))


class TableProposer(Proposer):
    name = "table"

    def __init__(self, table: torch.Tensor):
        self.table = table

    def propose(self, context, spec, sampling, generator) -> Proposal:
        tokens, tok = [], int(context[-1])
        for _ in range(spec.depth):
            tok = int(self.table[tok])
            tokens.append(tok)
        return Proposal.chain(tokens, device=context.device)  # q = None: deterministic candidates


class TableJob(Job):
    """Logits [V, V] learned against the target's greedy token after each one-token context; the artifact
    keeps their argmax."""

    kind = "table"

    def __init__(self, cfg: TableConfig, target, rows=None):
        self.cfg, self.target = cfg, target
        with torch.no_grad():
            self.greedy = target.model(input_ids=torch.arange(target.vocab_size)[:, None]).logits[:, -1].argmax(-1)

    def build_module(self) -> torch.nn.Module:
        module = torch.nn.Module()
        module.logits = torch.nn.Parameter(torch.zeros(self.target.vocab_size, self.target.vocab_size))
        return module

    def train_rows(self):
        return list(range(self.target.vocab_size))

    def collate(self, rows):
        context = torch.tensor(rows)
        return {"context": context, "label": self.greedy[context]}

    def loss(self, module, batch):
        logits = module.logits[batch["context"]]
        top1 = (logits.argmax(-1) == batch["label"]).float().mean().item()
        return torch.nn.functional.cross_entropy(logits, batch["label"]), {"top1": top1}

    def artifact_dest(self, default: Path) -> Path:
        return Path(self.cfg.output)

    def save_artifact(self, module, out_dir, metrics) -> Path:
        manifest = artifact.make_manifest("table", self.target.fingerprint(), to_dict(self.cfg))
        return artifact.save_artifact(self.artifact_dest(out_dir), manifest, {"table": module.logits.argmax(-1)},
                                      {"vocab_size": self.target.vocab_size})


def load_table(path, target=None) -> torch.Tensor:
    _, state = artifact.load_artifact(path, kind="table", target=target)
    return state["table"]


def export_table(artifact_dir, stack, out, target=None, num_speculative_tokens=4, verify=True, *, overwrite=False,
                 verifier=None):
    """The toy's own layouts, for the hf and vllm stacks, with its own serve.md text."""
    from safetensors.torch import save_file

    from draftsmith.layouts.heads import HeadExport, export_heads
    from draftsmith.layouts.serving import vllm_serve

    manifest, state = artifact.load_artifact(artifact_dir, kind="table", target=target)

    def write(tmp, fmt, target, target_ref, out, k):
        save_file({"table": state["table"].contiguous()}, str(tmp / "table.safetensors"))
        return target_ref

    def serve(stack, out, ref, k):
        if stack == "vllm":
            return vllm_serve(ref, "table-lookup", out, k)
        return f"Draft with `{out}/table.safetensors` beside `{ref}`.\n"

    plan = HeadExport("table", "a next-token table", {"hf": "table-v1", "vllm": "table-vllm"}, manifest, write, serve,
                      unsupported={"sglang": "SGLang has no table"})
    return export_heads(plan, Path(artifact_dir), stack, out, target, num_speculative_tokens, verify,
                        overwrite=overwrite, verifier=verifier)


def table_chain_problem(export_dir, k):
    return None if k <= 3 else f"{export_dir}: the table drafts at most 3 tokens, got k {k}"


def verify_table(out, target=None) -> list[str]:
    from draftsmith.layouts.verify import check, read_header

    names = sorted(read_header(Path(out) / "table.safetensors"))
    check(out, [] if names == ["table"] else [f"table.safetensors holds {names}"])
    return ["table.safetensors holds the table"]


def table_tensors(path):
    n = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    return {"table": ((n,), "")}, {}, []


@pytest.fixture
def table_method(tiny_target):
    from draftsmith.layouts.serving import Serving, VllmServe
    from draftsmith.layouts.verify import VERIFIERS

    # what export/'s drivers ask of it: how vLLM serves its vLLM layout, and a (made-up) measured refusal for the
    # tiny target's family, which an export for vLLM must warn of
    serving = Serving(vllm={"table-vllm": VllmServe("table-lookup", check=table_chain_problem)},
                      vllm_refuses={(tiny_target.config.model_type, "table"): "TableError: no table interface"})
    method = methods.register(methods.Method(
        name="table", summary="a next-token table read off the target", config=TableConfig, job=TableJob,
        load=load_table, proposer=lambda target, path, **opts: TableProposer(load_table(path, target)),
        export=export_table, serving=serving, tensors=table_tensors))
    for fmt in ("table-v1", "table-vllm"):
        VERIFIERS[fmt] = verify_table  # what a layout module's @register_verifier does
    yield method
    methods.unregister("table")
    CONFIG_KINDS.pop("table", None)
    for fmt in ("table-v1", "table-vllm"):
        VERIFIERS.pop(fmt, None)


@pytest.fixture
def table_artifact(table_method, tiny_target, tmp_path):
    from draftsmith.cli import main

    preset = tmp_path / "table.yaml"
    preset.write_text(f"kind: table\ntarget: {tiny_target.folder}\n")
    out = tmp_path / "table-artifact"
    assert main(["train", "table", "--config", str(preset), f"output={out}",
                 f"train.output_dir={tmp_path / 'table-run'}"]) == 0
    assert torch.equal(load_table(out), TableJob(None, tiny_target).greedy)  # the job learned every entry
    return out


def test_the_cli_and_the_config_loader_see_a_registered_method(table_method, tmp_path, capsys):
    from draftsmith.cli import build_parser

    args = build_parser().parse_args(["train", "table", "--config", "x.yaml"])
    assert args.job == "table"
    preset = tmp_path / "p.yaml"
    preset.write_text("kind: table\noutput: somewhere\n")
    cfg = load_config(preset)
    assert isinstance(cfg, TableConfig) and cfg.output == "somewhere"
    assert to_dict(cfg)["kind"] == "table"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "nonesuch"])
    assert "table" in capsys.readouterr().err  # argparse lists the registered methods


def test_a_registered_method_trains_checks_and_decodes_losslessly(table_artifact, tiny_target):
    from draftsmith.decoding.factory import build_proposer
    from draftsmith.decoding.generate import speculative_generate

    manifest = artifact.load_manifest(table_artifact, kind="table")
    assert manifest["kind"] == "table"
    problems, checks = inspect_artifact(table_artifact)
    assert problems == [] and any("tensors match the table module" in c for c in checks)

    proposer = build_proposer(f"table:{table_artifact}", tiny_target)
    assert isinstance(proposer, TableProposer)
    prompts = torch.randint(3, tiny_target.vocab_size, (3, 5), generator=torch.Generator().manual_seed(7))
    ref = tiny_target.model.generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0)[:, 5:]
    out = speculative_generate(tiny_target, proposer, prompts, max_new_tokens=16, eos_ids=[], k=3)
    assert out.tokens == ref.tolist()
    assert out.stats.proposed > 0 and out.stats.accepted > 0  # the table drafts, the target accepts some


def test_the_evaluator_retrain_bench_plan_and_export_see_a_registered_method(table_artifact, tiny_target, tmp_path):
    from draftsmith.benchmark.config import ArtifactStage
    from draftsmith.evaluation import evaluate
    from draftsmith.export.api import export_artifact, import_export, verify_export
    from draftsmith.memory.serving import artifact_shape
    from draftsmith.retrain.config import RetrainConfig

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": "", "turns": [t]})
                                 for t in ["Name three colors.", "What is a fox?"]) + "\n")
    report = evaluate(tiny_target, f"table:{table_artifact}", prompts=[str(prompts)], max_new_tokens=8, k=3,
                      cost_model=False)
    assert report["overall"]["lossless"] is True and report["overall"]["n_prompts"] == 2

    assert RetrainConfig(artifact_kind="table").artifact_kind == "table"
    assert ArtifactStage(name="t", job="table", config="x.yaml").job == "table"
    shape = artifact_shape(table_artifact, tiny_target.config)
    assert shape.kind == "table" and shape.params == tiny_target.vocab_size
    res = export_artifact(table_artifact, "hf", tmp_path / "export", tiny_target)
    assert res.format == "table-v1" and "table.safetensors" in res.files
    assert res.checks[-1] == "table.safetensors holds the table"
    assert "table.safetensors` beside" in (res.out / "serve.md").read_text()
    assert verify_export(res.out) == res.checks  # re-verified from draftsmith.json alone
    assert "# a next-token table for" in (res.out / "README.md").read_text()
    with pytest.raises(ConfigError, match="SGLang has no table"):
        export_artifact(table_artifact, "sglang", tmp_path / "export-sglang", tiny_target)
    assert not (tmp_path / "export-sglang").exists()

    # its vLLM layout, driven by export/ through the registry alone: the launch text, the measured refusal's
    # warning, the speculative config serve-check would hand vLLM and the chain length it refuses are the toy's
    from draftsmith.export.serve_check import speculative_config

    res = export_artifact(table_artifact, "vllm", tmp_path / "export-vllm", tiny_target)
    assert res.format == "table-vllm" and '"method": "table-lookup"' in (res.out / "serve.md").read_text()
    assert res.checks[-1].startswith("WARNING: vLLM") and "TableError: no table interface" in res.checks[-1]
    assert speculative_config(res.out, 3) == {"method": "table-lookup", "model": str(res.out.resolve()),
                                              "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="the table drafts at most 3 tokens, got k 4"):
        speculative_config(res.out, 4)
    with pytest.raises(ArtifactError, match="no method reads this layout back"):  # no reader claims every folder
        import_export(table_artifact, tmp_path / "back", fingerprint=tiny_target.fingerprint())


def test_unregistered_and_unknown_methods_are_one_line_errors(tiny_target):
    from draftsmith.decoding.factory import build_proposer

    assert methods.names()[:3] == ["draft", "medusa", "eagle"]
    with pytest.raises(ConfigError, match="unknown proposer 'table:x'"):
        build_proposer("table:x", tiny_target)
    with pytest.raises(ConfigError, match="unknown artifact kind 'table'"):
        methods.get("table")
    with pytest.raises(ConfigError, match="artifact_kind"):
        from draftsmith.retrain.config import RetrainConfig

        RetrainConfig(artifact_kind="table")
    with pytest.raises(ConfigError, match="already registered"):
        methods.register(methods.Method(name="medusa", summary="", config=None, job=None, load=None, proposer=None))


@pytest.mark.parametrize("listed_in", ["methods.BUILTIN", "cli.COMMAND_MODULES", "config.CONFIG_MODULES"])
def test_a_misspelled_module_in_a_list_of_modules_is_a_one_line_error(monkeypatch, listed_in):
    """A name no module answers to stops the program in one line naming the list, where it was once skipped
    as a subsystem not built yet (a misspelling hid a command or a config kind)."""
    from draftsmith import cli, config

    owner, attr = listed_in.split(".")
    module = {"methods": methods, "cli": cli, "config": config}[owner]
    monkeypatch.setattr(module, attr, (*getattr(module, attr), "draftsmith.evalution.commands"))
    monkeypatch.setattr(methods, "_METHODS", {})
    monkeypatch.setattr(methods, "_loaded", False)
    run = {"methods": methods.all_methods, "cli": cli.build_parser, "config": config._import_config_modules}[owner]
    with pytest.raises(ConfigError) as e:
        run()
    assert str(e.value) == (f"{listed_in} names 'draftsmith.evalution.commands', which is not a module "
                            "(no module named 'draftsmith.evalution')")


def test_every_builtin_method_folder_ships_in_the_wheel():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert set(methods.BUILTIN) <= set(pyproject["tool"]["setuptools"]["packages"])


def test_every_reference_of_the_builtin_methods_resolves():
    fields = ("config", "job", "load", "proposer", "export", "reimport", "memory", "tensors", "train_memory")
    for method in methods.all_methods():
        assert method.config is not None and method.proposer is not None and method.job is not None
        for what in fields:
            if getattr(method, what) is not None:
                assert callable(method.get(what)), (method.name, what)


def test_a_method_declares_its_other_name_once_and_types_its_references():
    """A method's other name is one field, `alias`: `draftsmith distill` runs `train draft`, and a bench preset's
    job or an artifact kind may say `distill` (once two fields, `command` and `aliases`, besides `cli` and
    `commands`). Every reference is typed `Ref[what it resolves to]`: no field is `Any`."""
    import dataclasses

    from draftsmith.cli import build_parser

    fields = {f.name: f.type for f in dataclasses.fields(methods.Method)}
    assert not {"command", "aliases", "cli"} & (set(fields) | set(vars(methods.Method)))
    refs = ("config", "job", "load", "proposer", "export", "reimport", "serving", "memory", "tensors",
            "train_memory", "features", "commands")
    assert [n for n in refs if not fields[n].startswith("Ref[")] == []
    assert [n for n, tp in fields.items() if "Any" in tp] == []
    draft = methods.get("distill")
    assert (draft.name, draft.alias) == ("draft", "distill") and methods.find("distill") is draft
    assert build_parser().parse_args(["distill", "--config", "x.yaml"]).job == "draft"
    assert [m.name for m in methods.all_methods() if m.alias] == ["draft"]
