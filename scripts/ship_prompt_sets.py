"""Write the public prompt sets the project ships (prompts/) from their source files, with the manifest.

    python scripts/ship_prompt_sets.py SOURCE_DIR [--out prompts] [--sets base|broad|all]

SOURCE_DIR holds the upstream files as they were downloaded (train/gsm8k_train.jsonl,
train/t0_prompts.jsonl, train/self_instruct_seed_tasks.jsonl, eval/eagle/{alpaca,gsm8k,humaneval}.jsonl,
eval/user_oriented_instructions.jsonl and their licence files). Training sets are stored gzip-compressed
(mtime 0, so the bytes are reproducible); evaluation sets stay plain jsonl (small, readable in a diff).

Every evaluation file is split in two, fixed here once: a row goes to `dev` or `test` by the parity of the
first byte of sha256("<file stem>:<row key>") (row key: question_id, id, else the line number). `dev` is what
choosing runs on (heads, recipes, trees, policies); `test` only reports (the headline numbers). The rule is
a hash, not a random draw, so a row's split never moves when a file grows.

`--sets broad` (re)writes only the sets of the domains a chat target is asked beyond those four (translation,
summarization and question answering over long passages, multi-turn chat: `ship_broad` below says how each is
made) and keeps the manifest's other entries; SOURCE_DIR then holds:
  wheels/django-5.2.19-py3-none-any.whl, wheels/sphinx-9.0.4-py3-none-any.whl
      (`pip download --no-deps django==5.2.19 sphinx==9.0.4`: their gettext catalogs are the parallel text),
  t0_train_50k/data_per_template/*.jsonl   (yizhongw/self-instruct at 0b26cca, data/finetuning/t0_train_50k:
      200 rows a P3 template, of which train/t0_prompts.jsonl.gz ships 40),
  eval/mt_bench/question.jsonl, eval/mt_bench/LICENSE   (lm-sys/FastChat at 0e6d3e4,
      fastchat/llm_judge/data/mt_bench/question.jsonl: MT-bench's 80 two-turn questions, Apache-2.0).

The manifest records, per file: path, what it is, upstream source, licence file, rows and sha256; the tests
read it back (tests/test_prompt_sets.py) so a changed or truncated file is caught.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import shutil
import sys
import zipfile
from pathlib import Path

from draftsmith.checksums import sha256_file

TRAIN = {
    "gsm8k_train.jsonl": ("grade-school math word problems: question, answer",
                          "openai/grade-school-math, train split", "LICENSES/gsm8k-MIT"),
    "t0_prompts.jsonl": ("NLP task prompts from 294 P3/T0 templates (QA over passages, summarisation, "
                         "classification, ...): source, prompt, reference",
                         "yizhongw/self-instruct data/finetuning/t0_train_50k (up to 40 rows a template)",
                         "LICENSES/self-instruct-Apache-2.0"),
    "self_instruct_seed_tasks.jsonl": ("hand-written instruction tasks with instances",
                                       "yizhongw/self-instruct data/seed_tasks.jsonl",
                                       "LICENSES/self-instruct-Apache-2.0"),
}
EVAL = {
    "eagle/alpaca.jsonl": ("general instructions (MT-bench style turns)", "SafeAILab/EAGLE eagle/data",
                           "LICENSES/eagle-Apache-2.0"),
    "eagle/gsm8k.jsonl": ("math word problems", "SafeAILab/EAGLE eagle/data", "LICENSES/eagle-Apache-2.0"),
    "eagle/humaneval.jsonl": ("Python function completion", "SafeAILab/EAGLE eagle/data",
                              "LICENSES/eagle-Apache-2.0"),
    "user_oriented_instructions.jsonl": ("user-oriented instructions tagged with the app they serve",
                                         "yizhongw/self-instruct human_eval", "LICENSES/self-instruct-Apache-2.0"),
}
SPLITS = ("dev", "test")
LICENSES = {"train/gsm8k_LICENSE": "gsm8k-MIT", "eval/self_instruct_LICENSE": "self-instruct-Apache-2.0",
            "eval/eagle/LICENSE": "eagle-Apache-2.0"}


def split_of(stem: str, key: str) -> str:
    """'dev' or 'test' for a row: the parity of sha256('<stem>:<key>')'s first byte."""
    return "dev" if hashlib.sha256(f"{stem}:{key}".encode()).digest()[0] % 2 == 0 else "test"


def _gzip(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                                      mtime=0, compresslevel=9) as g:
        shutil.copyfileobj(f, g)


def _entry(out: Path, path: Path, what: str, source: str, licence: str, rows: int) -> dict:
    return {"path": path.relative_to(out).as_posix(), "what": what, "source": source, "licence": licence,
            "rows": rows, "sha256": sha256_file(path)}


def ship(src: Path, out: Path, sets: str = "all", existing: list[Path] = ()) -> dict:
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "LICENSES").mkdir(exist_ok=True)
    for split in ("dev", "test"):
        (out / "eval" / split).mkdir(parents=True, exist_ok=True)
    if sets == "broad":
        old = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["files"]
        files = ([f for f in old if Path(f["path"]).name.split(".")[0] not in BROAD_FILES]
                 + ship_broad(src, out, existing))
        return _write_manifest(out, files)
    for rel, name in LICENSES.items():
        shutil.copyfile(src / rel, out / "LICENSES" / name)
    files = []
    for name, (what, source, licence) in TRAIN.items():
        dst = out / "train" / f"{name}.gz"
        _gzip(src / "train" / name, dst)
        rows = sum(1 for line in open(src / "train" / name, "rb") if line.strip())
        files.append(_entry(out, dst, what, source, licence, rows))
    for rel, (what, source, licence) in EVAL.items():
        stem = Path(rel).name.removesuffix(".jsonl")
        parts: dict[str, list[str]] = {"dev": [], "test": []}
        for lineno, line in enumerate(open(src / "eval" / rel, encoding="utf-8"), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            key = str(row.get("question_id", row.get("id", lineno)))
            parts[split_of(stem, key)].append(line.rstrip("\n") + "\n")
        for split, lines in parts.items():
            dst = out / "eval" / split / f"{stem}.jsonl"
            dst.write_text("".join(lines), encoding="utf-8")
            files.append(_entry(out, dst, f"{what} ({split} split)", source, licence, len(lines)))
    if sets == "all":
        files += ship_broad(src, out, existing)
    return _write_manifest(out, files)


def _write_manifest(out: Path, files: list[dict]) -> dict:
    manifest = {"about": "public prompt sets shipped with draftsmith; written by scripts/ship_prompt_sets.py",
                "split_rule": "eval rows: dev if sha256('<file stem>:<question_id|id|line>')[0] is even, else test",
                "files": files}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


# ------------------------------------------------------------------------------------ the broad sets
#
# What a chat model is asked beyond math, code and instructions: translation, summaries of and answers from long
# passages, and conversations of several turns. Every row carries its `domain`. Eval rows are carved out before
# the training files are written, and every eval row that a training row repeats or nearly repeats
# (draftsmith.data.overlap, at the presets' thresholds) is left out of the eval files.

BROAD_FILES = {"translation_pairs", "long_passages", "multiturn_followups", "translation", "summarization", "rag",
               "mt_bench"}
BROAD_LICENSES = {"django": "django-BSD-3-Clause", "sphinx": "sphinx-BSD-2-Clause", "mt_bench": "fastchat-Apache-2.0"}
LANGUAGES = {"fr": "French", "de": "German", "es": "Spanish", "it": "Italian", "pt_BR": "Portuguese", "nl": "Dutch",
             "ru": "Russian", "ja": "Japanese", "zh_Hans": "Chinese", "zh_CN": "Chinese"}
# P3 templates whose task is a summary of the passage, and those that answer a question from a passage
SUMMARY_TEMPLATES = (r"^(cnn_dailymail_3_0_0_(2_or_3|news_card|news_stock|news_summary|sum_in_brief|tldr|write_an_out)"
                     r"|multi_news_(distill|summarize|summary_scenario|synthesize|what_are)|xsum_|samsum_(?!Write))")
RAG_TEMPLATES = (r"^(adversarial_qa_\w+_(answer_the_following_q|based_on|question_context_answer|tell_what_it_is)"
                 r"|duorc_\w+_(answer_question|extract_answer|question_answering)"
                 r"|quoref_(?!Guess_Title)|ropes_)")
# P3 QA templates whose rows no shipped training file draws on, held out for the rag eval only (t0_prompts ships 40
# rows of each, so their passages are checked against it): WikiHop's queries over several retrieved Wikipedia
# paragraphs, a retrieval prompt as RAG serves one. P3's other QA templates share their passages with t0_prompts'
# and long_passages' rows, so few of theirs are left (the rag rows beyond what long_passages and the follow-ups
# take are used too). SciQ is left out: its licence is non-commercial.
RAG_EVAL_TEMPLATES = r"^wiki_hop_original_(choose_best_object_\w+|generate_object)$"
RAG_EVAL_WORDS = (150, 2000)  # several documents: up to ~2,700 tokens, well inside the targets' contexts
RAG_PER_PASSAGE = 3  # questions over one passage at most: more would weigh one document's acceptance
LONG_WORDS = (150, 700)  # a long passage: at least a few hundred tokens, and it fits a 1,024-token prompt
# rows per domain and split at most: enough for per-domain τ, cheap enough for make demo's evaluation
EVAL_PER_SPLIT = 48
TRAIN_PER_DOMAIN = 1200  # long-passage training rows per domain kept in the repository (a few MB compressed)
# second turns written for the project (MT-bench's kind of follow-up: rework the previous answer), applied to real
# first turns; none repeats an MT-bench turn
FOLLOW_UPS = ["Make that shorter: two sentences at most.", "Now explain it as you would to a ten-year-old.",
              "Give me the same as a bulleted list.", "Which part of your answer are you least sure about, and why?",
              "Rewrite it in a more formal tone.", "Add one concrete example.", "Translate your answer into French.",
              "Summarize your answer in one line.", "What would someone who disagrees say?",
              "Turn that into three questions a teacher could ask.", "Now give the answer a title.",
              "Say it again without any technical terms."]


def _bucket(tag: str, text: str) -> int:
    """0..255 from a hash of the text: which rows are held out, the template a row gets, its follow-up."""
    return hashlib.sha256(f"{tag}:{text}".encode()).digest()[0]


def read_po(text: str) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a gettext catalog's entries (blocks between blank lines): translated, not fuzzy,
    no plural forms and no context."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        entry: dict[str, str] = {}
        key, fuzzy = None, False
        for line in block.splitlines():
            m = re.match(r'(msgctxt|msgid_plural|msgid|msgstr(?:\[\d+\])?)\s+(".*")$', line)
            if line.startswith("#,") and "fuzzy" in line:
                fuzzy = True
            elif m:
                key = m.group(1)
                entry[key] = json.loads(m.group(2))
            elif line.startswith('"') and key:
                entry[key] += json.loads(line)
        if entry.get("msgid") and entry.get("msgstr") and not fuzzy and not {"msgid_plural", "msgctxt"} & set(entry):
            out.append((entry["msgid"], entry["msgstr"]))
    return out


def _sentence(msgid: str) -> bool:
    """A catalog string that reads as a sentence: five words or more, no placeholders or markup."""
    return len(msgid.split()) >= 5 and not re.search(r"[%{}<>\n]", msgid)


def parallel_sentences(wheels: Path) -> dict[str, dict[str, str]]:
    """English sentence -> {language: translation}, from Django's and Sphinx's catalogs (first wheel wins)."""
    pairs: dict[str, dict[str, str]] = {}
    origin: dict[str, str] = {}
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(n for n in z.namelist() if n.endswith(".po") and "/LC_MESSAGES/" in n):
                lang = name.split("/locale/")[1].split("/")[0]
                if lang not in LANGUAGES:
                    continue
                for msgid, msgstr in read_po(z.read(name).decode("utf-8")):
                    if _sentence(msgid) and not re.search(r"[%{}<>]", msgstr):
                        pairs.setdefault(msgid, {}).setdefault(LANGUAGES[lang], msgstr.replace("\xa0", " "))
                        origin.setdefault(msgid, wheel.name.split("-")[0].lower())
    return {k: {"origin": origin[k], **v} for k, v in pairs.items()}


_INTO = ["Translate the following text from English into {lang}:\n\n{text}",
         "How would you say this in {lang}?\n\n{text}", "Translate into {lang}: {text}"]
_FROM = ["Translate the following {lang} text into English:\n\n{text}", "What does this mean in English?\n\n{text}",
         "Translate from {lang} to English: {text}"]


def translation_rows(english: str, langs: dict[str, str]) -> list[dict]:
    """Both directions for every language the sentence was translated into; the template chosen by hash."""
    rows = []
    for lang, text in sorted((k, v) for k, v in langs.items() if k != "origin"):
        for direction, templates, src, ref in (("into", _INTO, english, text), ("from", _FROM, text, english)):
            tpl = templates[_bucket(f"{direction}:{lang}", english) % len(templates)]
            rows.append({"id": hashlib.sha256(f"{english}\x00{lang}\x00{direction}".encode()).hexdigest()[:16],
                         "domain": "translation", "pair": f"en-{lang}" if direction == "into" else f"{lang}-en",
                         "catalog": langs["origin"], "key": english, "prompt": tpl.format(lang=lang, text=src),
                         "text": src, "reference": ref})
    return rows


def long_passage_rows(t0_dir: Path, shipped: set[str]) -> list[dict]:
    """Summaries (`summarization`) and answers from passages (`rag`) of 150-700 words from the P3 templates'
    rows that train/t0_prompts.jsonl.gz does not ship."""
    def domain_of(template: str) -> str | None:
        return ("summarization" if re.search(SUMMARY_TEMPLATES, template) else
            "rag" if re.search(RAG_TEMPLATES, template) else None)

    return _t0_rows(t0_dir, domain_of, LONG_WORDS, shipped)


def _t0_rows(t0_dir: Path, domain_of, words: tuple[int, int], shipped: set[str]) -> list[dict]:
    """The rows of the P3 template files whose domain_of(template) is not None, of words[0]-words[1] words, that
    `shipped` does not hold; each taken prompt joins `shipped` (a prompt two templates render alike is kept once)."""
    rows = []
    for path in sorted(t0_dir.glob("*.jsonl")):
        domain = domain_of(path.stem)
        if domain is None:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            prompt = row["prompt"].strip()
            if prompt in shipped or not words[0] <= len(prompt.split()) <= words[1]:
                continue
            shipped.add(prompt)
            rows.append({"id": hashlib.sha256(prompt.encode()).hexdigest()[:16], "domain": domain,
                         "source": f"t0/{path.stem}", "prompt": prompt, "reference": row["completion"].strip()})
    return rows


def followup_rows(firsts: list[dict], chains: list[tuple[dict, dict]]) -> list[dict]:
    """Two-turn rows: a real first turn with one of FOLLOW_UPS (chosen by hash), and two translations of the same
    language pair asked one after the other ("And this one: ...")."""
    rows = []
    for r in firsts:
        rows.append({"id": f"f-{r['id']}", "domain": "multiturn", "built_from": r.get("source", r["domain"]),
                     "turns": [r["prompt"], FOLLOW_UPS[_bucket("follow-up", r["id"]) % len(FOLLOW_UPS)]]})
    for a, b in chains:
        rows.append({"id": f"c-{a['id']}-{b['id']}", "domain": "multiturn", "built_from": f"translation {a['pair']}",
                     "turns": [a["prompt"], f"And this one: {b['text']}"]})
    return rows


def _split_rows(rows: list[dict], tag: str, eval_share: int) -> tuple[list[dict], dict[str, list[dict]]]:
    """(train rows, {dev, test: eval rows}): a row is held out when its key's bucket is below `eval_share`/256,
    then goes to dev or test by split_of (capped after the overlap check, in _clean_eval)."""
    train, held = [], {"dev": [], "test": []}
    for r in rows:
        key = r.get("key", r["id"])
        if _bucket(tag, key) >= eval_share:
            train.append(r)
            continue
        held[split_of(tag, r["id"])].append(r)
    return train, held


def _clean_eval(held: dict[str, list[dict]], train_texts: list[str]) -> dict[str, list[dict]]:
    """The eval rows that no training text repeats or nearly repeats (draftsmith.data.overlap's rule), at most
    EVAL_PER_SPLIT a split, in their order. The eval rows are the side searched (find_overlap reports each of
    its rows once, at its first match), so every eval row near any training text is found."""
    from draftsmith.data.overlap import EvalText, find_overlap, ngrams
    from draftsmith.data.sources import PromptRow, normalize_text

    index = [EvalText(str(i), normalize_text(t), ngrams(normalize_text(t).split(), 8))
             for i, t in enumerate(train_texts)]
    out = {}
    for split, rows in held.items():
        bad = find_overlap([PromptRow(i, "e", "d", r["turns"], "") for i, r in enumerate(rows)], index).rows
        out[split] = [r for i, r in enumerate(rows) if i not in bad][:EVAL_PER_SPLIT]
    return out


def _write_jsonl(path: Path, rows: list[dict], gz: bool) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    if gz:
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as g:
            g.write(text)
    else:
        path.write_bytes(text)


def _shipped_prompts(out: Path) -> list[str]:
    texts = []
    for name in ("t0_prompts", "gsm8k_train", "self_instruct_seed_tasks"):
        with gzip.open(out / "train" / f"{name}.jsonl.gz", "rt", encoding="utf-8") as f:
            for row in map(json.loads, f):
                texts.append(row.get("prompt") or row.get("question") or row.get("instruction", ""))
    return texts


def _eval_row(r: dict, i: int) -> dict:
    turns = r.get("turns") or [r["prompt"]]
    return {"question_id": r.get("question_id", r["id"]), "domain": r["domain"], "turns": turns,
            **{k: r[k] for k in ("category", "pair", "source", "reference") if k in r}}


BROAD_SOURCES = {
    "translation": ("Django 5.2.19 and Sphinx 9.0.4 gettext catalogs (wheels on PyPI): English sentences of five "
                    "words or more and their translations", "LICENSES/translation-catalogs-BSD"),
    "long": ("yizhongw/self-instruct data/finetuning/t0_train_50k (P3 templates), rows not in t0_prompts",
             "LICENSES/self-instruct-Apache-2.0"),
    "multiturn": ("first turns from the long-passage and translation rows above; second turns: FOLLOW_UPS in "
                  "scripts/ship_prompt_sets.py or the next sentence of the same language pair",
                  "LICENSES/multiturn-NOTICE"),
    "mt_bench": ("lm-sys/FastChat fastchat/llm_judge/data/mt_bench/question.jsonl", "LICENSES/fastchat-Apache-2.0"),
    "rag": ("yizhongw/self-instruct data/finetuning/t0_train_50k (P3 templates): ROPES, AdversarialQA and WikiHop rows "
            "that no shipped training file or generated data set holds", "LICENSES/rag-eval-NOTICE"),
}
# the text of LICENSES/rag-eval-NOTICE in the shipped prompt sets, line for line (two of its lines are longer than 120)
RAG_NOTICE = """eval/{dev,test}/rag.jsonl: prompts of P3 (bigscience/P3, Apache-2.0) as yizhongw/self-instruct ships them in
data/finetuning/t0_train_50k (Apache-2.0, LICENSES/self-instruct-Apache-2.0). The passages and questions are those
of the datasets the P3 templates render, each under its own licence, kept here:
  - QAngaroo WikiHop (Welbl, Stenetorp and Riedel, 2018), Wikipedia paragraphs and queries: CC BY-SA 3.0
    (templates wiki_hop_original_*);
  - ROPES (Lin et al., 2019): CC BY 4.0 (templates ropes_*);
  - AdversarialQA (Bartolo et al., 2020), on SQuAD's Wikipedia passages: CC BY-SA 3.0 (templates adversarial_qa_*);
  - Quoref (Dasigi et al., 2019): CC BY 4.0; DuoRC (Saha et al., 2018): MIT (templates quoref_*, duorc_*).
Each row's `source` names its template. The rows are used as evaluation prompts only, unchanged.
"""  # noqa: E501


def _licences(src: Path, out: Path) -> None:
    with zipfile.ZipFile(next((src / "wheels").glob("django-*.whl"))) as z:
        django = z.read(next(n for n in z.namelist() if n.endswith("licenses/LICENSE"))).decode()
    with zipfile.ZipFile(next((src / "wheels").glob("sphinx-*.whl"))) as z:
        sphinx = z.read(next(n for n in z.namelist() if n.endswith("LICENSE.rst"))).decode()
    (out / "LICENSES" / "translation-catalogs-BSD").write_text(
        "Django's catalogs (django/**/locale/*/LC_MESSAGES/django.po):\n\n" + django +
        "\n\nSphinx's catalogs (sphinx/locale/*/LC_MESSAGES/sphinx.po):\n\n" + sphinx, encoding="utf-8")
    shutil.copyfile(src / "eval" / "mt_bench" / "LICENSE", out / "LICENSES" / "fastchat-Apache-2.0")
    (out / "LICENSES" / "rag-eval-NOTICE").write_text(RAG_NOTICE, encoding="utf-8")
    (out / "LICENSES" / "multiturn-NOTICE").write_text(
        "train/multiturn_followups.jsonl.gz: rows whose built_from is t0/... take their first turn from "
        "yizhongw/self-instruct (self-instruct-Apache-2.0); rows built from a translation pair take both turns from "
        "Django's and Sphinx's catalogs (translation-catalogs-BSD). The FOLLOW_UPS second turns are the project's "
        "own.\n", encoding="utf-8")


def _translation_sets(src: Path) -> tuple[list[dict], dict[str, list[dict]], list[tuple[dict, dict]]]:
    """Training rows, eval rows (one language pair and direction per held-out sentence) and two-turn chains."""
    rows = [r for en, langs in sorted(parallel_sentences(src / "wheels").items()) for r in translation_rows(en, langs)]
    train, held = [], {}
    for r in rows:
        (held.setdefault(r["key"], []) if _bucket("translation", r["key"]) < 64 else train).append(r)
    evals: dict[str, list[dict]] = {"dev": [], "test": []}
    for key, group in sorted(held.items()):
        pick = group[_bucket("pick", key) % len(group)]
        evals[split_of("translation", pick["id"])].append(pick)
    by_pair: dict[str, list[dict]] = {}
    for r in train:
        by_pair.setdefault(r["pair"], []).append(r)
    chains = [(g[i], g[i + 1]) for g in by_pair.values() for i in range(0, len(g) - 1, 12)]
    return train, evals, chains


def _long_sets(src: Path, out: Path) -> tuple[list[dict], dict[str, dict[str, list[dict]]], list[dict], list[dict]]:
    """Single-turn training rows, eval rows per domain (summarization, rag), first turns for follow-ups, and the
    rag rows that neither the training rows nor the follow-ups take (candidates for the rag eval)."""
    shipped = {p.strip() for p in _shipped_prompts(out)}
    rows = long_passage_rows(src / "t0_train_50k" / "data_per_template", shipped)
    train, firsts, evals, unused = [], [], {}, []
    for domain in ("summarization", "rag"):
        mine = sorted((r for r in rows if r["domain"] == domain), key=lambda r: _bucket("order", r["id"]))
        kept, evals[domain] = _split_rows(mine, domain, 64)  # a quarter: P3's QA templates share passages
        train += kept[:TRAIN_PER_DOMAIN]
        firsts += kept[TRAIN_PER_DOMAIN:TRAIN_PER_DOMAIN + 300]
        if domain == "rag":
            unused = kept[TRAIN_PER_DOMAIN + 300:]
    return train, evals, firsts, unused


def passage_key(prompt: str) -> str:
    """What identifies a prompt's passage across P3's templates: its longest line, normalised (a template adds
    its instruction around the passage and the question, not inside it)."""
    from draftsmith.data.sources import normalize_text

    return normalize_text(max(prompt.splitlines(), key=len))[:300]


def rag_eval_rows(t0_dir: Path, unused: list[dict], shipped: set[str]) -> dict[str, list[dict]]:
    """Candidate rag eval rows beyond long_passage_rows' held-out quarter: the rows of RAG_EVAL_TEMPLATES of
    RAG_EVAL_WORDS words, and the unused rows of RAG_TEMPLATES. One passage stays on one side: it goes to the
    split of its key (split_of), and only its rows whose own id splits the same way are taken, at most
    RAG_PER_PASSAGE, so the manifest's rule still places every row."""
    rows = list(unused) + _t0_rows(t0_dir, lambda t: "rag" if re.search(RAG_EVAL_TEMPLATES, t) else None,
                                   RAG_EVAL_WORDS, shipped)
    held: dict[str, list[dict]] = {"dev": [], "test": []}
    taken: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: _bucket("order", r["id"])):
        key = passage_key(r["prompt"])
        split = split_of("rag", key)
        if split_of("rag", r["id"]) == split and taken.get(key, 0) < RAG_PER_PASSAGE:
            taken[key] = taken.get(key, 0) + 1
            held[split].append(r)
    return held


def _without_eval(rows: list[dict], out: Path) -> list[dict]:
    """The training rows that repeat or nearly repeat no eval prompt of either split (all eval files)."""
    from draftsmith.data.config import EvalSetConfig
    from draftsmith.data.overlap import find_overlap, load_eval_texts
    from draftsmith.data.sources import PromptRow

    sets = [EvalSetConfig(str(p), turns="turns") for p in sorted((out / "eval").glob("*/*.jsonl"))
            if p.stem != "user_oriented_instructions"]
    sets += [EvalSetConfig(str(p), prompt_template="{instruction}\n\n{instances[0][input]}")
             for p in sorted((out / "eval").glob("*/user_oriented_instructions.jsonl"))]
    texts = load_eval_texts(sets, 8)
    prompts = [PromptRow(i, "t", "d", r.get("turns") or [r["prompt"]], "") for i, r in enumerate(rows)]
    bad = find_overlap(prompts, texts).rows
    return [r for i, r in enumerate(rows) if i not in bad]


def _dataset_prompts(folders: list[Path]) -> list[str]:
    """The prompts of generated data sets (their dataset/ folder) whose rows will be trained on again."""
    import datasets

    return [p for f in folders for p in datasets.load_from_disk(str(f / "dataset"))["prompt"]]


def _rag_eval(src: Path, out: Path, held: dict[str, list[dict]], unused: list[dict], train_texts: list[str],
              new_train: list[dict]) -> dict[str, list[dict]]:
    """The rag eval rows: long_passage_rows' held-out quarter (cleaned like the other domains), then the rows of
    rag_eval_rows, which must also be clear of every training row written here (long_passages and the follow-ups
    may not lose a line to them), and of every passage already taken, up to EVAL_PER_SPLIT a split."""
    first = _clean_eval({s: [_eval_row(r, 0) for r in v] for s, v in held.items()}, train_texts)
    shipped = {p.strip() for p in _shipped_prompts(out)} | {r["prompt"].strip() for s in held.values() for r in s}
    extra = rag_eval_rows(src / "t0_train_50k" / "data_per_template", unused, shipped)
    texts = train_texts + [t for r in new_train for t in (r.get("turns") or [r["prompt"]])]
    extra = _clean_eval({s: [_eval_row(r, 0) for r in v] for s, v in extra.items()}, texts)
    seen = {passage_key(r["turns"][0]) for rows in first.values() for r in rows}
    return {s: first[s] + [r for r in extra[s]
                           if passage_key(r["turns"][0]) not in seen][:EVAL_PER_SPLIT - len(first[s])]
            for s in SPLITS}


def ship_broad(src: Path, out: Path, existing: list[Path] = ()) -> list[dict]:
    """Translation, long passages and multi-turn: train files (gzip) and eval files (dev / test); manifest entries.

    An eval row is dropped when a shipped training set that may not change (its rows are keyed by line) or a
    generated data set in `existing` holds it or nearly holds it; a new training row near an eval row is
    dropped instead, so passages that P3's templates share stay on one side."""
    _licences(src, out)
    t_train, t_eval, chains = _translation_sets(src)
    l_train, l_eval, firsts, unused = _long_sets(src, out)
    m_train = followup_rows(firsts, chains)
    mt = [json.loads(x) | {"domain": "multiturn"}
          for x in (src / "eval/mt_bench/question.jsonl").read_text().splitlines() if x.strip()]
    mt_eval = {s: [r for r in mt if split_of("mt_bench", str(r["question_id"])) == s] for s in SPLITS}
    train_texts = _shipped_prompts(out) + _dataset_prompts(list(existing))
    evals = {"translation": _clean_eval({s: [_eval_row(r, 0) for r in v] for s, v in t_eval.items()}, train_texts),
             "summarization": _clean_eval({s: [_eval_row(r, 0) for r in v] for s, v in l_eval["summarization"].items()},
                                          train_texts),
             "rag": _rag_eval(src, out, l_eval["rag"], unused, train_texts, [*t_train, *l_train, *m_train]),
             "mt_bench": _clean_eval(mt_eval, train_texts)}
    files = []
    for stem, parts in evals.items():
        what, licence = BROAD_SOURCES[stem if stem in ("translation", "mt_bench", "rag") else "long"]
        for split in SPLITS:
            dst = out / "eval" / split / f"{stem}.jsonl"
            _write_jsonl(dst, parts[split], gz=False)
            files.append(_entry(out, dst, f"{stem} eval prompts, domain-tagged ({split} split)", what, licence,
                                len(parts[split])))
    for stem, rows, key in (("translation_pairs", t_train, "translation"), ("long_passages", l_train, "long"),
                            ("multiturn_followups", m_train, "multiturn")):
        rows = [{k: v for k, v in r.items() if k != "key"} for r in _without_eval(rows, out)]
        dst = out / "train" / f"{stem}.jsonl.gz"
        _write_jsonl(dst, rows, gz=True)
        what, licence = BROAD_SOURCES[key]
        files.append(_entry(out, dst, f"{stem} (domain per row)", what, licence, len(rows)))
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "prompts")
    ap.add_argument("--sets", choices=("base", "broad", "all"), default="all",
                    help="base: the first four domains' sets; broad: only translation, long passages and multi-turn "
                         "(the manifest's other entries kept); all: both")
    ap.add_argument("--existing", type=Path, action="append", default=[],
                    help="a generated data set (folder with dataset/) that will grow: no eval row may be one of its "
                         "prompts (repeatable)")
    args = ap.parse_args(argv)
    m = ship(args.source, args.out, args.sets, args.existing)
    for f in m["files"]:
        print(f"{f['path']:55s} {f['rows']:6d} rows  {f['sha256'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
