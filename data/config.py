"""Configuration of the data pipeline: prompt sources, chat formatting, self-distillation, capture.

`DataConfig` (YAML `kind: data`) is what `draftsmith data generate` reads. Every range and every
cross-field rule is checked in `__post_init__`, so a bad preset fails at load time with the key named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from draftsmith.capture.config import CaptureConfig
from draftsmith.config import (
    DRAFT_TOKENS,
    FRACTION,
    MAX_BATCH,
    PROBABILITY,
    ROWS,
    SECONDS,
    SEED,
    TEMPERATURE,
    TOKENS,
    Range,
    check_tree,
    register_config,
    validated,
)
from draftsmith.data.hub_sets import apply_hub_set
from draftsmith.data.reasoning import DEFAULT_TAGS, POLICIES
from draftsmith.paths import data_path
from draftsmith.targets.context import MAX_NEW_TOKENS


@validated
@dataclass
class DomainRule:
    """Rows whose `field` matches `pattern` (re.search) get `domain`. Rules are tried in order."""

    field: str
    pattern: str
    domain: str

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"domain rule pattern {self.pattern!r} is not a valid regex ({e})") from None
        if not self.domain:
            raise ValueError("domain rule needs a non-empty domain")


MAPPINGS = ("prompt", "prompt_template", "turns", "conversations", "messages")


@validated
@dataclass
class SourceConfig:
    """One prompt source.

    type: jsonl (one JSON object per line, `.gz` read decompressed), hf (a `datasets` dataset: a `save_to_disk`
    folder, data files (.json/.jsonl/.parquet/.csv) or a hub name where the hub is reachable), hub (a dataset on
    the Hugging Face hub by `id`, with its `config` name, `split` and `revision`: `datasets.load_dataset`, which
    reads it from the local datasets cache when it was downloaded before or HF_DATASETS_OFFLINE=1 is set;
    pin `revision` so that a rerun reads the same rows), stdlib (code prompts built from
    the Python standard library), magpie (`limit` user requests the chat-tuned target writes itself when
    given its chat template up to a user turn; data/magpie.py).

    Field mapping (jsonl / hf): exactly one of
      prompt           a field name; dotted paths index into nested values (`instances.0.input`);
      prompt_template  a str.format template over the row (`"{instruction}\\n\\n{instances[0][input]}"`);
      turns            a field holding a list of user turns (multi-turn: the target answers each in turn);
      conversations    a ShareGPT field: [{"from": "human"|"gpt"|"system", "value": text}, ...];
      messages         an OpenAI messages field: [{"role": "user"|"assistant"|"system", "content": text}, ...].
    With `prompt` or `prompt_template`, `response` names the field holding the row's own answer (Alpaca's
    `output`, GSM8K's `answer`): a single-turn conversation whose answer `responses: keep` trains on.
    A conversation is an optional system message, then user and assistant messages in turn; its assistant
    messages are the dataset's own responses (trained on with `responses: keep`, else the target rewrites
    them). `roles` maps further role names (`{bing: assistant}`); any other role is a malformed row.
    `id_field` names a field used as the stable row key (default: the line / row number).

    `preset: sharegpt | ultrachat | perfectblend` names a standard chat set (data/hub_sets.py): its hub id,
    split, mapping, roles and domains fill whatever the source does not give itself; with `path` the preset
    reads a local copy of the set (`type: hf`) instead of the hub.

    Reasoning targets (data/reasoning.py): `chat_template_kwargs` are passed to every chat-template call that
    builds this source's rows (prompts the target answers, loss masks, magpie requests), e.g.
    `{enable_thinking: true}` for Qwen3, over the data config's `chat.template_kwargs`; `reasoning` (keep, drop,
    mask; default: the data config's `reasoning`) says what the rows do with the thinking span of an answer.
    """

    name: str
    type: Literal["jsonl", "hf", "hub", "stdlib", "magpie"] = "jsonl"
    # a standard chat set by name (data/hub_sets.py): its hub id, split and mapping, where the source is silent
    preset: str | None = None
    path: str | None = None
    split: str = "train"  # hf and hub
    id: str | None = None  # hub only: the dataset id, e.g. HuggingFaceH4/ultrachat_200k
    config: str | None = None  # hub only: the dataset's configuration name (load_dataset's `name`)
    revision: str | None = None  # hub only: a commit, tag or branch
    prompt: str | None = None
    prompt_template: str | None = None
    turns: str | None = None
    conversations: str | None = None  # ShareGPT
    messages: str | None = None  # OpenAI chat messages
    response: str | None = None  # the row's own answer to its prompt / prompt_template (kept with responses: keep)
    roles: dict[str, str] = field(default_factory=dict)  # extra role names -> user / assistant / system
    system: str | None = None  # optional system message for every row of this source (a row's own wins)
    id_field: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: Literal["keep", "drop", "mask"] | None = None
    domain: str | None = None  # fixed domain, or the fallback when no rule matches
    domain_rules: list[DomainRule] = field(default_factory=list)
    limit: Annotated[int, ROWS] | None = None
    sample: Literal["first", "random"] = "random"  # which `limit` rows: the first ones, or a seeded sample
    seed: Annotated[int, SEED] = 0
    # stdlib only
    # share of function-completion prompts (rest: module continuation)
    completion_fraction: Annotated[float, FRACTION] = 0.6
    chunk_lines: Annotated[int, Range(ge=2, le=10_000)] = 24  # lines of module text shown in a continuation prompt
    # magpie only: `limit` user requests written by the target itself (data/magpie.py)
    temperature: Annotated[float, TEMPERATURE] = 1.0
    top_p: Annotated[float, PROBABILITY] = 1.0
    max_request_tokens: Annotated[int, TOKENS] = 96  # a request that has not ended by then is dropped
    min_request_chars: Annotated[int, Range(ge=0, le=10**6)] = 12

    def __post_init__(self):
        if self.preset is not None:
            apply_hub_set(self, MAPPINGS)
        self.domain_rules = [DomainRule(**r) if isinstance(r, dict) else r for r in self.domain_rules]
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name or ""):
            raise ValueError(f"source name {self.name!r} must be non-empty [A-Za-z0-9_.-]")
        if self.type == "hub" and not (self.id and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", self.id)):
            raise ValueError(f"source '{self.name}': type hub needs an id like ORG/NAME, got {self.id!r}")
        if self.type != "hub" and (self.id or self.config or self.revision):
            raise ValueError(f"source '{self.name}': id, config and revision go with type hub")
        if self.type in ("jsonl", "hf", "hub"):
            if self.type != "hub" and not self.path:
                raise ValueError(f"source '{self.name}': type {self.type} needs a path")
            given = [k for k in MAPPINGS if getattr(self, k)]
            if len(given) != 1:
                raise ValueError(
                    f"source '{self.name}': give exactly one of {', '.join(MAPPINGS)} (got {given or 'none'})"
                )
        if self.response is not None and not (self.prompt or self.prompt_template):
            raise ValueError(f"source '{self.name}': response goes with prompt or prompt_template (a single-turn "
                             "row and its answer; conversations and messages carry their own answers)")
        for name, role in self.roles.items():
            if role not in ("user", "assistant", "system"):
                raise ValueError(f"source '{self.name}': roles.{name} must be user, assistant or system, got {role!r}")
        if self.type == "magpie":
            if self.limit is None:
                raise ValueError(f"source '{self.name}': type magpie needs limit (how many requests to write)")
            if self.temperature <= 0 or not 0.0 < self.top_p <= 1.0:
                raise ValueError(f"source '{self.name}': magpie samples; temperature must be > 0, top_p in (0, 1]")
        if not self.domain and not self.domain_rules:
            raise ValueError(f"source '{self.name}': give a domain or domain_rules")
        check_template_kwargs(self.chat_template_kwargs, f"sources.{self.name}.chat_template_kwargs")
        if self.reasoning is not None and self.reasoning not in POLICIES:
            raise ValueError(f"sources.{self.name}.reasoning must be keep, drop or mask, got {self.reasoning!r}")

    @property
    def has_responses(self) -> bool:
        """Whether rows carry the dataset's own assistant turns (ShareGPT / messages, a response field, or the
        standard library's code after each prompt)."""
        return bool(self.conversations or self.messages or self.response) or self.type == "stdlib"


@validated
@dataclass
class EvalSetConfig:
    """A held-out prompt set: nothing resembling it may enter training."""

    path: str
    prompt: str | None = None
    prompt_template: str | None = None
    turns: str | None = None

    def __post_init__(self):
        given = [k for k in ("prompt", "prompt_template", "turns") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"eval set {self.path}: give exactly one of prompt, prompt_template, turns")


# arguments of apply_chat_template that draftsmith sets itself: a source's chat_template_kwargs may not set them
OWNED_TEMPLATE_ARGS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                       "chat_template", "return_dict", "return_tensors", "tools", "documents"}


def check_template_kwargs(kwargs: Any, where: str) -> None:
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ValueError(f"{where} must be a mapping of template variable names to values")
    owned = sorted(set(kwargs) & OWNED_TEMPLATE_ARGS)
    if owned:
        raise ValueError(f"{where}: {', '.join(owned)} is set by draftsmith for each call, not by the config")


@validated
@dataclass
class ChatConfig:
    """How a conversation becomes tokens.

    mode: auto (the tokenizer's chat template if it has one, else plain continuation), chat (require a
    template), plain (prompt text then response text, no template).
    """

    mode: Literal["auto", "chat", "plain"] = "auto"
    system: str | None = None  # default system message (a source's own `system` wins)
    plain_separator: str = "\n"  # plain mode: text between a user turn and the response
    add_bos: bool = True  # plain mode: prepend the tokenizer's BOS token when it has one
    # variables every chat-template call gets (a source's chat_template_kwargs win), e.g. {enable_thinking: false}
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the tags around a response's thinking span (data/reasoning.py): Qwen3's and DeepSeek-R1's by default
    think_tags: list[str] = field(default_factory=lambda: list(DEFAULT_TAGS))

    def __post_init__(self):
        check_template_kwargs(self.template_kwargs, "chat.template_kwargs")
        tags = self.think_tags
        if not (isinstance(tags, list) and len(tags) == 2 and all(isinstance(t, str) and t.strip() for t in tags)
                and tags[0] != tags[1]):
            raise ValueError("chat.think_tags must be two different non-empty strings (opening, closing), "
                             f"got {tags!r}")


@dataclass(frozen=True)
class SourceChat:
    """How one source's conversations are rendered and what its rows do with thinking spans."""

    template_kwargs: dict[str, Any]
    reasoning: str
    think_tags: tuple[str, str]

    def describe(self) -> dict[str, Any]:
        """What provenance.json and the resume key record of it."""
        return {"chat_template_kwargs": dict(self.template_kwargs), "reasoning": self.reasoning,
                "think_tags": list(self.think_tags)}


# request fields the OpenAI backend sets from GenerationConfig; extra_body may not override them (a server told
# max_tokens 10**9 through extra_body would write past max_new_tokens)
OWNED_REQUEST_FIELDS = {"model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                        "n", "best_of", "stream", "echo"}


@validated
@dataclass
class GenerationConfig:
    """Self-distillation sampling and the decode engine."""

    max_new_tokens: Annotated[int, Range(ge=1, le=MAX_NEW_TOKENS)] = 160
    max_prompt_tokens: Annotated[int, TOKENS] = 512  # longer prompts are malformed rows ("prompt too long")
    do_sample: bool = False
    temperature: Annotated[float, Range(gt=0, le=100)] = 0.7
    top_p: Annotated[float, PROBABILITY] = 0.95
    seed: Annotated[int, SEED] = 0
    # rows decoded together (continuous batching keeps the batch full)
    batch_size: Annotated[int, Range(ge=1, le=MAX_BATCH)] = 32
    engine: Literal["continuous", "hf", "speculative"] = "continuous"  # hf = transformers `generate`, for comparison
    # speculative = on-policy rollouts (data/engines/rollout.py): our speculative decoder with `proposer` (e.g. the head
    # being trained) writes the rows, one row at a time; they are the target's rows (lossless) and each one
    # records where verification rejected the draft (column `replay`, read by EAGLE's replay_weight)
    proposer: str | None = None  # engine speculative: a proposer spec, e.g. eagle:zoo/smollm2-135m/eagle3
    # engine speculative: branching per depth (null: a chain of k)
    tree: list[Annotated[int, DRAFT_TOKENS]] | None = None
    k: Annotated[int, DRAFT_TOKENS] = 6  # engine speculative: chain length when tree is null
    # engine speculative: decode as `draftsmith evaluate --tree auto` does, with the proposer's own tree cut
    # every step to the nodes that pay on this device (v(n) measured first); overrides tree and k
    tree_auto: bool = False
    threads: Annotated[int, Range(ge=1, le=1024)] | None = 2  # torch intra-op threads (None leaves torch's default)
    # the target's dtype while it writes: auto = bf16 on a GPU or a CPU with native bf16 (AVX512-BF16 / AMX),
    # else float32 (targets/precision.py; where the CPU has native bf16 it writes faster, BENCHMARKS.md)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    fp32_logits: bool = True  # a bf16 body still computes its logits in float32 (fewer changed greedy tokens)
    # completed rows per chunk file (a crash loses at most this many)
    flush_every: Annotated[int, Range(ge=1, le=10**6)] = 16
    # who writes: engine = the embedded decode loop above (one device); openai = any OpenAI-compatible
    # completions server (vLLM, SGLang, `transformers serve`); several base_urls share the rows (data/engines/remote.py)
    backend: Literal["engine", "openai"] = "engine"
    base_urls: list[str] = field(default_factory=list)  # e.g. http://gpu-node-1:8000/v1
    served_model: str | None = None  # the name the servers serve the target under (default: their only one)
    concurrency: Annotated[int, Range(ge=1, le=1024)] = 8  # requests in flight per server
    # per request and server, on connection errors, timeouts, HTTP 429 / 5xx
    max_retries: Annotated[int, Range(ge=0, le=100)] = 4
    # seconds before the first retry; doubled for each next one
    retry_backoff: Annotated[float, Range(ge=0, le=3600)] = 1.0
    # seconds a whole request may take (a deadline, not per read) before it counts as failed
    request_timeout: Annotated[float, SECONDS] = 300.0
    # text: send the prompt as text (checked to re-tokenize to the exact ids); token_ids: send the ids
    # themselves (vLLM and SGLang accept them; exact even where a tokenizer would add a BOS of its own)
    prompt_as: Literal["text", "token_ids"] = "text"
    api_key_env: str | None = None  # name of the environment variable holding the servers' API key
    extra_body: dict = field(default_factory=dict)  # more request fields, e.g. {return_token_ids: true} (vLLM)

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"generation.dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.engine not in ("continuous", "hf", "speculative"):
            raise ValueError(f"generation.engine must be continuous, hf or speculative, got {self.engine!r}")
        if self.engine == "speculative":
            if not self.proposer:
                raise ValueError("generation.engine speculative needs generation.proposer (e.g. eagle:PATH)")
            if self.backend != "engine":
                raise ValueError("generation.engine speculative runs on this machine: it needs backend: engine")
            check_tree(self.tree, "generation.tree")
        if self.backend not in ("engine", "openai"):
            raise ValueError(f"generation.backend must be engine or openai, got {self.backend!r}")
        if self.backend == "openai":  # no base_urls is refused by DataConfig (capture.backend vllm starts its own)
            bad = [u for u in self.base_urls if not re.match(r"https?://[^/\s]+", u)]
            if bad:
                raise ValueError(f"generation.base_urls: {bad[0]!r} is not an http(s) address")
            if len(set(self.base_urls)) != len(self.base_urls):
                raise ValueError("generation.base_urls: an address repeats")
        if self.prompt_as not in ("text", "token_ids"):
            raise ValueError(f"generation.prompt_as must be text or token_ids, got {self.prompt_as!r}")
        if not isinstance(self.extra_body, dict):
            raise ValueError("generation.extra_body must be a mapping of request fields")
        owned = sorted(set(self.extra_body) & OWNED_REQUEST_FIELDS)
        if owned:
            raise ValueError(f"generation.extra_body: {', '.join(owned)} set by draftsmith from the generation "
                             "settings (max_new_tokens, do_sample, temperature, top_p, seed); set those instead")


@register_config("data")
@validated
@dataclass
class DataConfig:
    """Self-distillation dataset: prompts from `sources`, responses written by `target`."""

    sources: list[SourceConfig]
    output_dir: str
    target: str = "smollm2-135m"
    chat: ChatConfig = field(default_factory=ChatConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    malformed: Literal["skip", "fail"] = "skip"
    # keep: train on the dataset's own assistant turns (the EAGLE-1 recipe; no generation); regenerate: the
    # target answers every user turn itself, turn by turn
    responses: Literal["regenerate", "keep"] = "regenerate"
    # what rows do with an answer's thinking span (keep, drop, mask: data/reasoning.py); a source's own wins
    reasoning: Literal["keep", "drop", "mask"] = "keep"
    dedupe: bool = True  # drop rows whose normalised prompt repeats an earlier row
    eval_sets: list[EvalSetConfig] = field(default_factory=list)
    eval_dirs: list[str] = field(default_factory=list)  # no source may read from inside these folders
    overlap: Literal["drop", "warn", "fail"] = "drop"
    overlap_ngram: Annotated[int, Range(ge=2, le=64)] = 8
    overlap_jaccard: Annotated[float, PROBABILITY] = 0.5  # n-gram Jaccard at or above this is a near-duplicate
    # cap on the total after filtering (seeded shuffle keeps the domain mix)
    max_rows: Annotated[int, ROWS] | None = None
    seed: Annotated[int, SEED] = 0

    def __post_init__(self):
        if not self.sources:
            raise ValueError("sources: give at least one prompt source")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: duplicate source name {dup[0]!r} (names key the rows)")
        if not self.output_dir:
            raise ValueError("output_dir must be set")
        if self.reasoning not in POLICIES:
            raise ValueError(f"reasoning must be keep, drop or mask, got {self.reasoning!r}")
        if self.responses not in ("regenerate", "keep"):
            raise ValueError(f"responses must be regenerate or keep, got {self.responses!r}")
        self._check_servers()
        if self.responses == "keep":
            bare = [s.name for s in self.sources if not s.has_responses]
            if bare:
                raise ValueError(f"sources.{bare[0]}: responses: keep needs conversations, messages, a "
                                 "response field or type stdlib (a source with assistant turns to keep)")
        forbidden = [data_path(d).resolve() for d in self.eval_dirs]
        forbidden += [data_path(e.path).resolve() for e in self.eval_sets]
        for s in self.sources:
            if s.path is None:
                continue
            p = data_path(s.path).resolve()
            for f in forbidden:
                if p == f or f in p.parents:
                    raise ValueError(f"sources.{s.name}: {s.path} is held-out eval data ({f}); "
                                     "it may not be trained on")

    def _check_servers(self) -> None:
        """Who writes and who captures: servers need addresses, except the capture replica draftsmith starts
        itself (capture.backend vllm with no base_urls); capture by vLLM needs servers that write the answers,
        and, in a fleet, the folder its connector writes into."""
        gen, cc = self.generation, self.capture
        if gen.backend == "openai" and not gen.base_urls and cc.backend != "vllm":
            raise ValueError("generation.backend openai needs base_urls (one or more server addresses)")
        if cc.backend != "vllm":
            return
        if gen.backend != "openai":
            raise ValueError("capture.backend vllm takes the features from the servers that write the answers: it "
                             "needs generation.backend: openai")
        if self.responses == "keep":
            raise ValueError("capture.backend vllm captures what the servers write; responses: keep writes nothing "
                             "(use capture.backend: target)")
        if gen.base_urls and not cc.served_dir:
            raise ValueError("capture.backend vllm with generation.base_urls needs capture.served_dir (the "
                             "connector's capture_dir, readable here)")

    def source_chat(self, name: str) -> SourceChat:
        """The chat-template arguments and reasoning policy of source `name` (its own over the defaults)."""
        src = next(s for s in self.sources if s.name == name)
        return SourceChat({**self.chat.template_kwargs, **src.chat_template_kwargs},
                          src.reasoning or self.reasoning, (self.chat.think_tags[0], self.chat.think_tags[1]))
