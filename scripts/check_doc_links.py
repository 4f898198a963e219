#!/usr/bin/env python3
"""Check that what README.md and docs/*.md cite exists.

    python scripts/check_doc_links.py            # exit 1 when something cited is missing
    python scripts/check_doc_links.py -v         # also list what was checked and skipped

Four kinds of citation are checked, in prose (inline code) and in fenced code blocks alike:

- markdown links ``[text](path#anchor)``: the file (relative to the citing file) and, with an anchor,
  a heading of that file whose GitHub slug is the anchor;
- repository paths in backticks (``hamo_ray/selection.py``, ``jobs/configs/paper-qwen3-{8b,14b}-within.yaml``,
  brace lists expanded): they must exist relative to the repository root when their first part is a
  top-level entry of the repository; a bare file name (``reward.py``) must name some file of the
  repository; paths a run writes (``runs/...``, ``results/scores.csv``, ``state.json``) are skipped;
- dotted ``hamo_ray.*`` names: the module must exist and the first name after it must be defined in it;
- config keys (``train.pack_tokens``, ``memory.distiller=llm``): the section and field must exist in
  ``hamo_ray.config.HamoConfig`` (checked when the package imports; run it with ``.venv/bin/python``).

Paths that are cited on purpose before they exist (another change writes them) are listed in
``PENDING`` and reported, not failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Cited before they exist: written by another change or by a running experiment.
PENDING = {
    "docs/results.md": "the learning experiments (written by another change)",
    "results/smollm2-within/": "exported by jobs/configs/sweep-smollm2-within.yaml as its cells finish",
}
# Files of other projects, named where the text says whose they are.
EXTERNAL = {"llm_config.py", "goal.py", "setup.sh", "auth_token", "served_adapters.json"}
# Written by runs, sweeps, benchmarks or the install, relative to a run folder or the home directory.
RUNTIME_PREFIXES = (
    "runs/",
    "results/",
    "benchmarks/results/",
    ".venv/",
    "memory/",
    "episodes/",
    "trajectories/",
    "adapters/",
    "tensorboard/",
    "train/",
    "cells/",
)
RUNTIME_FILES = {
    "adapter_config.json",
    "state.json",
    "key.json",  # a shared stage 0 entry (eval.initial_cache)
    "config.yaml",
    "report.md",
    "error.txt",
    "metrics.json",
    "scores.csv",
    "summary.json",
    "table.md",
    "episodes.csv",
    "stagewise.png",
    "bars.png",
    "retention.png",
}
FILE_EXTS = (
    ".py",
    ".yaml",
    ".yml",
    ".md",
    ".sh",
    ".txt",
    ".jinja",
    ".toml",
    ".json",
    ".jsonl",
    ".csv",
    ".png",
    ".gz",
    ".cfg",
)
SECTIONS = (
    "run",
    "method",
    "model",
    "backbone",
    "env",
    "protocol",
    "prompt",
    "memory",
    "selection",
    "replay",
    "train",
    "serve",
    "rollout",
    "ray",
)
NOT_KEYS = {"ray.init", "ray.serve", "ray.llm", "ray.train", "ray.data", "ray.get", "ray.remote"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
KEY = re.compile(rf"^({'|'.join(SECTIONS)})\.([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?")
DOTTED = re.compile(r"^hamo_ray(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> set[str]:
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            found.add(slug(m.group(1)))
    return found


def expand(token: str) -> list[str]:
    """Brace lists, as the shell expands them: a-{x,y}-b -> a-x-b, a-y-b."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not m:
        return [token]
    return [p for alt in m.group(1).split(",") for p in expand(token[: m.start()] + alt + token[m.end() :])]


def tokens(text: str) -> list[str]:
    out = []
    for raw in re.split(r"[\s\"'`]+", text):
        tok = raw.strip("()[],;:'\"").rstrip(".")
        if tok:
            out.append(tok)
    return out


def tracked() -> tuple[set[str], set[str], set[str]]:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")]  # new pages not yet added
    top = {f.split("/")[0] for f in files}
    return set(files), top, {Path(f).name for f in files}


def config_fields():
    """The config's sections: (HamoConfig, BaseModel, {domain: its env.<domain> settings model})."""
    try:
        sys.path.insert(0, str(ROOT))
        from pydantic import BaseModel

        from hamo_ray.config import HamoConfig
    except Exception as exc:  # the check then skips config keys, and says so
        return None, f"config keys not checked ({type(exc).__name__}: {exc})"
    try:  # per-domain settings (env.<domain>.*), registered by the domains
        from hamo_ray.config.env import env_sections

        domains = env_sections()
    except ImportError:
        domains = {}
    return (HamoConfig, BaseModel, domains), None


def check_key(match: re.Match, cfg) -> bool:
    hamo, base_model, domains = cfg
    section = hamo.model_fields[match.group(1)].annotation
    field = section.model_fields.get(match.group(2))
    sub = match.group(3)
    if field is None:
        if match.group(1) == "env" and match.group(2) in domains:
            return sub is None or sub in domains[match.group(2)].model_fields
        return False
    if sub is None:
        return True
    ann = field.annotation
    if isinstance(ann, type) and issubclass(ann, base_model):
        return sub in ann.model_fields
    return True  # a dict or list field: anything below it is a value, not a key


def check_dotted(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for module in (base.with_suffix(".py"), base / "__init__.py"):
            if module.is_file():
                rest = parts[i:]
                if not rest:
                    return None
                src = module.read_text()
                pat = rf"^(?:def|class|async def)\s+{rest[0]}\b|^{rest[0]}\s*[:=]|\b{rest[0]}\b.*# re-export|^\s+{rest[0]},?$|import .*\b{rest[0]}\b"
                if not re.search(pat, src, re.M):
                    return f"{rest[0]!r} not defined in {module.relative_to(ROOT)}"
                if len(rest) > 1 and not re.search(rf"def {rest[1]}\b|^\s+{rest[1]}\s*[:=]", src, re.M):
                    return f"{rest[1]!r} not found in {module.relative_to(ROOT)}"
                return None
    return "no such module"


class Checker:
    """Collects what the documents cite, and what of it is missing."""

    def __init__(self) -> None:
        self.files, self.top, self.names = tracked()
        self.cfg, self.cfg_note = config_fields()
        self.problems: list[str] = []
        self.pending: set[str] = set()
        self.skipped: list[str] = []
        self.counts = dict.fromkeys(("links", "paths", "names", "keys", "skipped"), 0)

    def link(self, doc: Path, where: str, target: str) -> None:
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            return
        self.counts["links"] += 1
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        rel = str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            if rel in PENDING:
                self.pending.add(rel)
            else:
                self.problems.append(f"{where}: link {target!r}: {rel} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in headings(dest):
            self.problems.append(f"{where}: link {target!r}: no heading #{anchor} in {rel}")

    def token(self, where: str, tok: str) -> None:
        if m := DOTTED.match(tok):
            self.counts["names"] += 1
            if err := check_dotted(m.group(0)):
                self.problems.append(f"{where}: {m.group(0)}: {err}")
            return
        key = tok.split("=", 1)[0]
        m = KEY.match(key)
        if m and not key.endswith(FILE_EXTS) and key[m.end() : m.end() + 1] != "(":
            if self.cfg is None or any(key.startswith(n) for n in NOT_KEYS):
                return
            self.counts["keys"] += 1
            # not a key but a module path written from inside the package (memory.pipeline.x): fine
            if not check_key(m, self.cfg) and check_dotted("hamo_ray." + key) is not None:
                self.problems.append(f"{where}: config key {m.group(0)!r} does not exist")
            return
        if "=" in tok or "://" in tok or tok.startswith(("/", "~", "$", "-", "<", ".venv")):
            return
        if "/" not in tok and not tok.endswith(FILE_EXTS):
            return
        if not re.fullmatch(r"[\w.\-/{},<>*$]+", tok):
            return
        for cand in expand(tok):
            self.path(where, cand)

    def path(self, where: str, cand: str) -> None:
        def exists(rel: str) -> bool:
            return (ROOT / rel).is_dir() if rel.endswith("/") else (ROOT / rel).exists()

        if any(c in cand for c in "<>*$") or (cand.startswith(".") and not cand.startswith(".ci")):
            self.counts["skipped"] += 1  # a placeholder or a glob
        elif (cand in PENDING or cand.rstrip("/") + "/" in PENDING) and not exists(cand):
            self.pending.add(cand.rstrip("/") + "/" if cand.rstrip("/") + "/" in PENDING else cand)
        elif cand.startswith("results/") and cand.count("/") == 1 and "." in cand:
            # a run folder's results/<file>; the repository's are results/<sweep>/
            self.counts["skipped"] += 1
        elif cand.startswith("benchmarks/results/"):
            self.counts["skipped"] += 1  # written by the benchmarks, ignored by git
        elif "/" in cand and cand.split("/")[0] in self.top:
            self.counts["paths"] += 1
            if not exists(cand):
                self.problems.append(f"{where}: path {cand!r} does not exist")
        elif "/" not in cand:
            if cand in RUNTIME_FILES or cand in EXTERNAL:
                self.counts["skipped"] += 1
            elif cand in self.names or (ROOT / cand).exists():
                self.counts["paths"] += 1
            else:
                self.problems.append(f"{where}: file name {cand!r} matches no file of the repository")
        else:  # relative to a run folder, a package or another project
            self.counts["skipped"] += 1
            if not cand.startswith(RUNTIME_PREFIXES):
                self.skipped.append(f"{where}: {cand}")

    def document(self, doc: Path) -> None:
        fenced = False
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{lineno}"
            if line.startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                for target in LINK.findall(line):
                    self.link(doc, where, target)
            for span in [line] if fenced else INLINE.findall(line):
                for tok in tokens(span):
                    self.token(where, tok)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="also list the paths not checked")
    args = parser.parse_args()
    checker = Checker()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in docs:
        checker.document(doc)
    c = checker.counts
    print(
        f"checked {len(docs)} documents: {c['links']} links, {c['paths']} paths, {c['names']} hamo_ray "
        f"names, {c['keys']} config keys; {c['skipped']} run-time or placeholder paths skipped"
    )
    if args.verbose:
        for line in checker.skipped:
            print(f"skipped {line}")
    if checker.cfg_note:
        print(checker.cfg_note)
    for rel in sorted(checker.pending):
        print(f"pending (cited before it exists): {rel}: {PENDING[rel]}")
    for problem in checker.problems:
        print(problem)
    print("ok" if not checker.problems else f"{len(checker.problems)} problems")
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main())
